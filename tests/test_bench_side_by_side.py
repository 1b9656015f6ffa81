"""bench/side_by_side.py on the CPU: its smoke mode trains every contender that runs without
CUDA (resident, resident with checkpointing, atomc's activation policies) on the same weights
and batches, and says why the CUDA-only ones (FSDP2, MegaTrain, DeepSpeed) are skipped; the
premise of bench/megatrain_driver.py (decoder layers called with no mask under SDPA are the
causal model) holds for the installed transformers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import side_by_side  # noqa: E402

CUDA_ONLY = ("fsdp2", "fsdp2-ckpt", "megatrain", "deepspeed")


@pytest.mark.slow
def test_smoke_trains_every_cpu_contender_on_the_same_weights(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "side.json"
    assert side_by_side.main(["--smoke", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    (row,) = json.loads(out.read_text())["rows"]
    res = row["contenders"]
    assert row["config"] == "tiny-llama" and row["accum"] == 2
    assert row["tokens_per_step"] == 2 * 16
    plain = res["resident"]["losses"]
    assert res["resident"]["step_ms"] > 0 and len(plain) == 2
    # checkpointing recomputes the same function: the same losses, step for step
    assert res["resident-ckpt"]["losses"] == pytest.approx(plain, rel=1e-4)
    accepted = side_by_side.accepted_policies() or ()
    assert "recompute" in accepted
    for policy in side_by_side.POLICIES:
        r = res[f"atomc-{policy}"]
        if policy not in accepted:
            assert policy in r["skipped"] and "installed atomc" in r["skipped"]
            continue
        if policy == "recompute" or "skipped" not in r:
            assert "error" not in r, r
            # swapped training of the same weights on the same batches: the plain model's
            # losses up to bfloat16 rounding of the device copies
            assert r["losses"] == pytest.approx(plain, rel=2e-3), policy
            assert r["submodels"] >= 1 and r["accum"] == 2
            assert r["transfer_dtype"] == "bfloat16" and r["predicted_step_ms"] > 0
        else:  # a policy whose plan does not fit the smoke budget says what would
            assert "budget" in r["skipped"] or "GPU" in r["skipped"]
    for name in CUDA_ONLY:
        assert "CUDA" in res[name]["skipped"], name
    assert side_by_side.RESULTS_HEADER in printed
    assert "-tiny-llama-atomc-recompute |" in printed
    assert "atomc-recompute tokens/s / resident" in printed
    # a run cut short keeps its JSON, from which --report prints the same tables
    assert side_by_side.main(["--report", str(out)]) == 0
    again = capsys.readouterr().out
    assert again.strip() and again.strip() in printed


def test_link_share_is_the_union_of_the_copies():
    assert side_by_side.busy_share([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)], 10.0) == 0.4
    assert side_by_side.busy_share([(0.0, 4.0), (1.0, 2.0)], 8.0) == 0.5
    assert side_by_side.busy_share([], 5.0) == 0.0
    assert side_by_side.busy_share([(0.0, 1.0)], 0.0) == 0.0


@pytest.mark.parametrize("argv, named", [
    (["--contenders", "atomc,magic"], "magic"),
    (["--configs", "llama-13t"], "llama-13t"),
    (["--gpu-mem", "lots"], "lots"),
    (["--megatrain", "/nonexistent/MegaTrain"], "/nonexistent/MegaTrain"),
])
def test_bad_options_are_one_line(argv, named, capsys):
    assert side_by_side.main(["--smoke", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err, err


def test_without_cuda_the_cuda_only_contenders_say_why():
    import megatrain_driver

    cpu = torch.device("cpu")
    assert "CUDA" in megatrain_driver.unavailable("anywhere", cpu)
    if torch.cuda.is_available():
        cuda = torch.device("cuda", 0)
        assert "--megatrain" in megatrain_driver.unavailable(None, cuda)
        assert "cpu_master.py" in megatrain_driver.unavailable(str(REPO), cuda)


def test_sdpa_layers_without_a_mask_are_the_causal_model():
    """What bench/megatrain_driver.py relies on: MegaTrain's layer-by-layer forward (embedding,
    each decoder layer with the model's rotary embeddings, norm, head) with attention_mask=None
    under SDPA is the model's own causal forward, and the 2-D padding mask MegaTrain would pass
    instead is refused by SDPA."""
    pytest.importorskip("transformers")
    import megatrain_driver

    torch.manual_seed(0)
    model = megatrain_driver.hf_model("tiny-llama", None, torch.float32).eval()
    assert model.config._attn_implementation == "sdpa"
    B, T = 2, 12
    ids = torch.randint(0, model.config.vocab_size, (B, T))
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
        position_ids = torch.arange(T).unsqueeze(0).expand(B, -1)
        head_dim = model.config.hidden_size // model.config.num_attention_heads
        cos_sin = model.model.rotary_emb(torch.empty(1, 1, T, head_dim), position_ids[:1])
        kwargs = {"position_ids": position_ids, "position_embeddings": cos_sin,
                  "cache_position": torch.arange(T), "use_cache": False}
        h = model.model.embed_tokens(ids)
        for layer in model.model.layers:
            out = layer(h, attention_mask=None, **kwargs)
            h = out[0] if isinstance(out, tuple) else out
        got = model.lm_head(model.model.norm(h))
        assert torch.allclose(got, expected, atol=1e-5)
        with pytest.raises(RuntimeError, match="attn_mask"):
            model.model.layers[0](model.model.embed_tokens(ids),
                                  attention_mask=torch.ones(B, T, dtype=torch.long), **kwargs)

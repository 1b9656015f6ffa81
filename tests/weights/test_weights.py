"""Pretrained weights in and out of the swap runtime (atomc.weights, docs/checkpoints.md).

- In: a sharded safetensors checkpoint (and a sharded .bin one) loads the weights that a
  state dict of the same model loads, tensor by tensor: a subprocess's peak RSS stays within
  the host store (plus the CPU "device" slots) and one tensor.
- Out: Hugging Face Llama, Qwen2 and GPT-2 (tied embeddings) models trained from their own
  `save_pretrained` directories and exported: `from_pretrained` gives the logits of the
  trainer's sub-models (float32, 1e-5); the CLI does the same (`atomc train --weights`,
  `atomc export`).
- peft: a LoRA model trained from a base checkpoint equals plain peft training (3 steps,
  float64); its adapter loads back with peft. Its frozen base weights have no gradient buffer
  (host or device), no gradient copy, no optimizer state and no CPU update.
- Bad input: a checkpoint of another model (names, shapes), a missing or an extra tensor, a
  file that is not a checkpoint: one line each, exit 2 from the CLI.

Nothing is downloaded: every checkpoint is a tiny model built from a config and saved here.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atomc.cli import main as atomc_main
from atomc.codegen import generate
from atomc.codegen.manual import plan_from_cuts
from atomc.errors import RuntimeMismatchError, UsageError
from atomc.runtime import SwapTrainer
from atomc.runtime.checkpoint import digest
from atomc.trace import load_model_file, trace_model

from helpers.plain import plain_run
from processes import child_env, kill_tree

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402 - transformers brings safetensors

REPO = Path(__file__).resolve().parents[2]
HF = REPO / "examples" / "hf.py"
LORA = Path(__file__).resolve().parents[1] / "models" / "peft_lora.py"
MICRO = 2
SEQ = 16


_PACKAGES: dict = {}


def package(path: Path, config: str | None, root: Path, parts: int, accum: int = 1) -> Path:
    """A package of the model file cut into `parts` sub-models of about equal node counts
    (made once per test run)."""
    key = (str(path), config, parts, accum)
    if key not in _PACKAGES:
        traced = trace_model(path, config, MICRO, device="cpu")
        n = len(traced.graph.nodes)
        first = 1 + max(i for i, node in enumerate(traced.graph.nodes) if node.op == "placeholder")
        cuts = [first + (n - first) * k // parts for k in range(1, parts)]
        out = root / f"{path.stem}-{config or 'default'}-{parts}-{accum}"
        _PACKAGES[key] = generate(plan_from_cuts(traced, cuts, accum), out, traced=traced)
    return _PACKAGES[key]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("weights")


def hf_model(config: str, seed: int = 0):
    """examples/hf.py's model (a wrapper whose `model` is the transformers model)."""
    module = load_model_file(HF)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return module.build_model(config)


def chain_logits(trainer: SwapTrainer, ids: torch.Tensor) -> torch.Tensor:
    """The trainer's own forward: its host sub-models (views of the masters) in eval mode."""
    modules = trainer.host_modules
    for m in modules:
        m.eval()
    try:
        with torch.no_grad():
            values: tuple = (ids,)
            for m in modules[:-1]:
                values = m(*values)
            return modules[-1](*values)
    finally:
        for m in modules:
            m.train()


def token_ids(rows: int, seed: int, vocab: int = 128) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (rows, SEQ), generator=g)


def one_line_error(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    assert atomc_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


# ---------------------------------------------------------------------------------------------
# in: tensor by tensor, within the host store and one tensor

MLP_FILE = '''
import torch
from torch import nn

WIDTH, DEPTH = 1024, 8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.norm(x)


def build_model(config=None):
    return Net()


def example_inputs(model, batch_size):
    return (torch.randn(batch_size, WIDTH),)


def loss_fn(outputs, batch):
    return outputs.square().mean()
'''

RSS_PROBE = '''
import json, sys
import torch
from atomc.runtime import SwapTrainer
from atomc.runtime.checkpoint import digest


def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024


package, weights = sys.argv[1:3]
# one-time costs that are not the loading's: the fused AdamW kernels' first use (~80 MB of code)
p = torch.nn.Parameter(torch.zeros(8))
p.grad = torch.zeros(8)
torch.optim.AdamW([p], fused=True).step()
try:  # the peak so far is the imports': start it again here (Linux 4.0+)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
before = status("VmRSS")
trainer = SwapTrainer.from_package(package, device="cpu", weights=weights,
                                   threaded_optimizer=False)
peak = status("VmHWM")
slots = trainer.executor.slots
print(json.dumps({
    "before": before, "peak": peak, "store": trainer.store.host_bytes(),
    "slots": sum(t.numel() * t.element_size() for t in slots.params + slots.grads),
    "digest": digest(trainer.export_state_dict())}))
'''


def test_sharded_checkpoint_loads_within_the_store_and_one_tensor(root, tmp_path):
    """Safetensors shards with their index, as Hugging Face ships a model: the weights a state
    dict of the same model gives, and the loading process grows by the host store (and, on a
    CPU run, the two weight and gradient slots that stand in for device memory) plus at most
    the largest tensor and a small margin: the original model is never built."""
    from huggingface_hub import save_torch_state_dict
    model_file = root / "mlp.py"
    model_file.write_text(MLP_FILE)
    pkg = package(model_file, None, root, parts=8)
    model = load_model_file(model_file).build_model()
    state = model.state_dict()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_torch_state_dict(state, ckpt, max_shard_size="20MB")
    assert (ckpt / "model.safetensors.index.json").is_file()
    largest = max(t.numel() * t.element_size() for t in state.values())

    # glibc raises its mmap threshold past a freed 4 MiB read, and keeps the next ones freed in
    # its heap: RSS then counts 0-6 such reads the loader no longer holds (seen: 8-24 MiB from
    # run to run); a fixed threshold returns each to the system, so RSS is what the loader holds
    env = {**child_env(), "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    proc = subprocess.Popen([sys.executable, "-c", RSS_PROBE, str(pkg), str(ckpt)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, err[-2000:]
    got = json.loads(out.strip().splitlines()[-1])
    assert got["digest"] == digest(state)
    margin = 16 << 20
    grown = got["peak"] - got["before"]
    bound = got["store"] + got["slots"] + largest + margin
    assert grown <= bound, (f"grew {grown >> 20} MiB: store {got['store'] >> 20} MiB, slots "
                            f"{got['slots'] >> 20} MiB, largest tensor {largest >> 20} MiB")
    # the same model held once more (what state_dict= of a built model costs) would not fit
    assert bound < got["store"] + got["slots"] + sum(t.nbytes for t in state.values())

    # PyTorch .bin shards with their index: the same weights
    bins = tmp_path / "bins"
    bins.mkdir()
    save_torch_state_dict(state, bins, max_shard_size="20MB", safe_serialization=False)
    assert (bins / "pytorch_model.bin.index.json").is_file()
    trainer = SwapTrainer.from_package(pkg, device="cpu", weights=bins)
    assert digest(trainer.export_state_dict()) == digest(state)
    trainer.close()


# ---------------------------------------------------------------------------------------------
# out: transformers loads what the trainer trained


@pytest.mark.parametrize("config", ["tiny-llama", "tiny-qwen2", "tiny-gpt2"])
def test_export_loads_in_transformers_with_the_trainers_logits(root, tmp_path, config):
    """The model's own save_pretrained directory (sharded) in, two steps, exported: the same
    initial weights as state_dict=, and from_pretrained gives the trained sub-models' logits
    (GPT-2's output layer is tied to its input embedding: written once, as transformers
    writes it)."""
    pkg = package(HF, config, root, parts=2, accum=2)
    model = hf_model(config)
    ckpt = tmp_path / "hf"
    model.model.save_pretrained(ckpt, max_shard_size="40KB")
    assert (ckpt / "model.safetensors.index.json").is_file()

    trainer = SwapTrainer.from_package(pkg, device="cpu", weights=ckpt)
    reference = SwapTrainer.from_package(pkg, device="cpu", state_dict=model.state_dict())
    assert digest(trainer.export_state_dict()) == digest(reference.export_state_dict())
    reference.close()
    for step in range(2):
        trainer.step(token_ids(2 * MICRO, step))

    out = tmp_path / "out"
    assert trainer.save_pretrained(out, max_shard_size="40KB") == out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = {out / f for f in index["weight_map"].values()}
    on_disk = {k: v for f in files for k, v in load_file(f).items()}
    tied = json.loads((out / "atomc-export.json").read_text())["tied"]
    assert tied == ({"lm_head.weight": "transformer.wte.weight"} if config == "tiny-gpt2"
                    else {})
    assert set(on_disk) == set(index["weight_map"]) == set(model.model.state_dict()) - set(tied)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.dtype == torch.float32
    ids = token_ids(MICRO, 7)
    with torch.no_grad():
        expected = chain_logits(trainer, ids)
        got = loaded(input_ids=ids).logits
    assert torch.allclose(got, expected, rtol=0, atol=1e-5), (got - expected).abs().max()
    trained = trainer.export_state_dict()
    head = "model.lm_head.weight"
    assert not torch.equal(trained[head], model.state_dict()[head])
    trainer.close()

    # written again over the earlier export (atomic replacement); a foreign directory is refused
    trainer = SwapTrainer.from_package(pkg, device="cpu", weights=out)
    assert digest(trainer.export_state_dict()) == digest(trained)
    trainer.save_pretrained(out, dtype="bfloat16")
    assert {f.name for f in out.iterdir()} >= {"model.safetensors", "config.json"}
    assert all(t.dtype == torch.bfloat16 for t in load_file(out / "model.safetensors").values())
    with pytest.raises(RuntimeMismatchError, match="not a directory atomc exported"):
        trainer.save_pretrained(ckpt)
    trainer.close()


def test_cli_train_from_weights_then_export(root, tmp_path, capsys):
    """`atomc train --weights DIR --checkpoint run.pt` then `atomc export --checkpoint run.pt`:
    transformers loads the result; the weights of a resumed run come from its checkpoint."""
    import numpy as np
    pkg = package(HF, "tiny-llama", root, parts=2, accum=2)
    model = hf_model("tiny-llama", seed=5)
    ckpt = tmp_path / "hf"
    model.model.save_pretrained(ckpt)
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 128, 4000).astype(np.int32))
    run = tmp_path / "run.pt"
    common = [str(pkg), "--weights", str(ckpt), "--device", "cpu", "--data", str(tokens),
              "--checkpoint", str(run)]
    assert atomc_main(["train", *common, "--steps", "1"]) == 0
    assert atomc_main(["train", *common, "--steps", "2", "--resume", str(run)]) == 0
    assert "its weights replace" in capsys.readouterr().out
    out = tmp_path / "out"
    assert atomc_main(["export", str(pkg), "--checkpoint", str(run), "-o", str(out)]) == 0
    assert "step 2" in capsys.readouterr().out
    trainer = SwapTrainer.from_package(pkg, device="cpu", checkpoint=run)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = token_ids(MICRO, 3)
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, chain_logits(trainer, ids),
                              rtol=0, atol=1e-5)
    trainer.close()
    err = one_line_error(capsys, ["export", str(pkg), "-o", str(tmp_path / "x")])
    assert "--checkpoint FILE" in err and "--weights PATH" in err
    # a checkpoint converted to the model's format without training: the same weights
    again = tmp_path / "again"
    assert atomc_main(["export", str(pkg), "--weights", str(ckpt), "-o", str(again)]) == 0
    assert load_file(again / "model.safetensors").keys() == model.model.state_dict().keys()


def test_export_writes_a_tied_weight_once_and_loading_ties_it_again(root, tmp_path, capsys):
    """The README's mini GPT (its output layer tied to the embedding), not a transformers
    model: `atomc export` writes the tied weight once and records the other name (the
    safetensors writer refused two names over one memory); the files read back with safetensors
    and tied again are the trainer's weights exactly, and `--weights` takes them back."""
    from safetensors import safe_open

    from atomc.weights import tied_names

    gpt = REPO / "examples" / "gpt.py"
    pkg = package(gpt, "mini", root, parts=3)
    torch.manual_seed(0)
    trainer = SwapTrainer.from_package(pkg, device="cpu",
                                       state_dict=load_model_file(gpt).build_model("mini")
                                       .state_dict())
    trainer.step(torch.randint(0, 256, (MICRO, 64), generator=torch.Generator().manual_seed(1)))
    run = tmp_path / "run.pt"
    trainer.save_checkpoint(run)
    expected = trainer.export_state_dict()
    trainer.close()
    out = tmp_path / "out"
    assert atomc_main(["export", str(pkg), "--checkpoint", str(run), "-o", str(out)]) == 0
    tied = tied_names(out)
    assert tied == {"lm_head.weight": "wte.weight"}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["atomc.tied"]) == tied
    state = load_file(out / "model.safetensors")
    assert "lm_head.weight" not in state
    state.update({other: state[name] for other, name in tied.items()})
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], v) for k, v in expected.items())
    model = load_model_file(gpt).build_model("mini")
    model.load_state_dict(state, strict=True)
    assert model.lm_head.weight is model.wte.weight
    back = SwapTrainer.from_package(pkg, device="cpu", weights=out)
    assert digest(back.export_state_dict()) == digest(expected)
    back.close()


# ---------------------------------------------------------------------------------------------
# peft: LoRA adapters


def lora_setup(root: Path, tmp_path: Path):
    """(package, the peft model as build_model(seed 0) makes it in float64, the base model's
    Hugging Face checkpoint). The adapter's B starts at zero, so the base is the peft model
    without its adapter."""
    pytest.importorskip("peft")
    pkg = package(LORA, None, root, parts=3, accum=2)
    torch.manual_seed(0)
    ref = load_model_file(LORA).build_model().double()
    base = tmp_path / "base"
    copy.deepcopy(ref.model).unload().save_pretrained(base, max_shard_size="30KB")
    return pkg, ref, base


def test_lora_trains_as_peft_and_its_adapter_loads_back(root, tmp_path):
    """Base weights from their checkpoint, the adapter as the model file initialises it: three
    float64 steps give plain peft training's losses and weights; the exported adapter is
    peft's own format, and PeftModel.from_pretrained over the base gives the same logits."""
    from peft import PeftModel

    pkg, ref, base = lora_setup(root, tmp_path)
    module = load_model_file(LORA)
    trainer = SwapTrainer.from_package(pkg, device="cpu", weights=base,
                                       optimizer={"lr": 1e-2})
    assert trainer.store.master_dtype == torch.float64  # the checkpoint's
    batches = [token_ids(2 * MICRO, s) for s in range(3)]
    swapped = [trainer.step(b) for b in batches]
    plain = plain_run(ref, module.loss_fn, batches, 2)
    assert swapped == pytest.approx(plain, rel=1e-12, abs=0)
    exported = trainer.export_state_dict()
    for name, value in ref.state_dict().items():
        assert torch.allclose(exported[name], value, rtol=0, atol=1e-12), name

    out = tmp_path / "adapter"
    trainer.save_pretrained(out)
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {f.name for f in out.iterdir()}
    base_model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64)
    peft_model = PeftModel.from_pretrained(base_model.eval(), out).eval()
    ids = batches[0][:MICRO]
    with torch.no_grad():
        assert torch.allclose(peft_model(input_ids=ids).logits, ref.eval()(ids), rtol=0,
                              atol=1e-12)
    trainer.close()

    # the base and the trained adapter, as two weights paths: training goes on from there
    again = SwapTrainer.from_package(pkg, device="cpu", weights=[base, out])
    assert digest(again.export_state_dict()) == digest(exported)
    again.close()


def test_frozen_weights_get_no_gradient_buffer_copy_state_or_update(root, tmp_path):
    """A LoRA model's frozen base: the host gradient buffers, the device gradient slots and
    the gradient copy hold the adapter's weights only, no optimizer state, no gradient norm,
    and an update does not cast them into the image again (float64 masters behind a float32
    image: a frozen weight's image, perturbed here, stays as it is)."""
    pkg, ref, _ = lora_setup(root, tmp_path)
    trainer = SwapTrainer.from_package(pkg, device="cpu", state_dict=ref.state_dict(),
                                       transfer_dtype="float32")
    store, slots = trainer.store, trainer.executor.slots
    assert store.mode == "separate"
    trainable = [sum(e.span or e.numel for e in L.entries if e.trainable) for L in store.layouts]
    frozen = [sum(e.numel for e in L.entries if not e.trainable) for L in store.layouts]
    assert all(f > 10 * t for f, t in zip(frozen, trainable))
    assert [store.grad(i).numel() for i in range(len(store.layouts))] == trainable
    owned = [L.trainable_numel for L in store.layouts]  # moments: owned trainable weights only
    assert [m.numel() for pair in store.moments for m in pair] == [n for n in owned for _ in "mv"]
    assert all(g.numel() == max(trainable) for g in slots.grads)
    for i, module in enumerate(trainer.executor.modules):
        for name, p in module.named_parameters():
            assert (p.grad is not None) == p.requires_grad, (i, name)
    owned_trainable = sum(1 for L in store.layouts for e in L.entries if e.owned and e.trainable)
    assert len(trainer.optimizer.norm_order) == owned_trainable

    layout = store.layouts[0]
    entry = next(e for e in layout.entries if e.owned and not e.trainable)
    image = entry.image_view(store.image[0])
    image.add_(1.0)
    perturbed = image.clone()
    before = {e.key: store.read_entry(0, e).clone() for e in layout.entries if e.owned}
    trainer.step(token_ids(2 * MICRO, 0))
    trainer.wait()
    assert torch.equal(image, perturbed)  # no cast of a frozen master into the image
    for e in layout.entries:
        if e.owned:
            changed = not torch.equal(store.read_entry(0, e), before[e.key])
            assert changed == e.trainable, e.key
    assert sum(len(o.wheres) for o in trainer.optimizer.optims if o is not None) == \
        owned_trainable
    trainer.close()


# ---------------------------------------------------------------------------------------------
# bad input


def test_checkpoints_of_another_model_are_refused_in_one_line(root, tmp_path, capsys):
    """Another model's names, another configuration's shapes, a missing or an extra tensor,
    a file that is not a checkpoint, both weights= and state_dict=: one line, naming it."""
    from safetensors.torch import save_file
    pkg = package(HF, "tiny-llama", root, parts=2, accum=2)
    gpt2 = tmp_path / "gpt2"
    hf_model("tiny-gpt2").model.save_pretrained(gpt2)
    wide = tmp_path / "wide"
    config = transformers.AutoConfig.for_model(
        "llama", hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
        max_position_embeddings=64)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(wide)
    state = hf_model("tiny-llama").model.state_dict()
    missing = tmp_path / "missing.safetensors"
    save_file({k: v for k, v in state.items() if k != "model.norm.weight"}, missing)
    extra = tmp_path / "extra.safetensors"
    save_file({**state, "model.extra.bias": torch.zeros(3)}, extra)
    not_a_state_dict = tmp_path / "list.pt"
    torch.save([1, 2, 3], not_a_state_dict)
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"not a safetensors file")

    cases = {
        gpt2: ["none of the", "'transformer.", "the model's are named like 'model."],
        wide: ["has shape [128, 64]", "[128, 32]", "another model or configuration"],
        missing: ["lacks weight 'model.model.norm.weight'", "'model.norm.weight'"],
        extra: ["'model.extra.bias'", "does not have"],
        not_a_state_dict: ["holds a list, not a state dict"],
        broken: ["not a readable safetensors file"],
        tmp_path / "absent": ["does not exist"],
    }
    for path, words in cases.items():
        err = one_line_error(capsys, ["train", str(pkg), "--weights", str(path), "--steps", "1",
                                      "--device", "cpu"])
        for w in words:
            assert w in err, (path.name, err)
    # what older transformers wrote, and the model now computes, is not one of them
    older = tmp_path / "older.safetensors"
    save_file({**state, **{f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(4)
                           for i in range(2)}}, older)
    SwapTrainer.from_package(pkg, device="cpu", weights=older).close()
    with pytest.raises(UsageError, match="not both"):
        SwapTrainer.from_package(pkg, device="cpu", weights=gpt2, state_dict=state)
    err = one_line_error(capsys, ["train", str(pkg), "--adapter", str(gpt2), "--steps", "1"])
    assert "--weights" in err

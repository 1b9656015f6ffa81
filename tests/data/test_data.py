"""`atomc train` on a user's own data: token-id files, text and JSONL through a tokenizer,
datasets saved to disk; held-out loss; a settings file; a record of the run.

The model is the hand-written GPT split (tests/fixtures/gpt_split: vocabulary 256, C = 2
micro-batches of 2 sequences of 16 tokens, so 64 ids a step). Tokenizers are trained here
with the tokenizers package and saved with save_pretrained: nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from atomc.cli import main as atomc_main
from atomc.data import PackedBatches, held_out, model_vocabulary, open_source, token_input
from atomc.data import sources as data_sources
from atomc.errors import UsageError
from atomc.runtime import SwapTrainer
from atomc.runtime.evaluate import eval_loss
from atomc.runtime.package import load_swap_package

REPO = Path(__file__).resolve().parents[2]
GPT_SPLIT = REPO / "tests" / "fixtures" / "gpt_split"
ROWS, SEQ = 4, 16  # C x micro-batch sequences of SEQ ids a step
WORDS = ("the quick brown fox jumps over a lazy dog while seven small birds sing in "
         "green trees near an old stone bridge").split()


def documents(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 30)))) for _ in range(n)]


def make_tokenizer(path: Path, vocab_size: int, byte_level: bool = False) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if byte_level:  # 256 byte symbols and merges: more ids than the model has
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet,
                                  special_tokens=["<|endoftext|>", "<unk>"])
    tok.train_from_iterator(documents(300, seed=9), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                            unk_token="<unk>").save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer", 120)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return data_sources.load_tokenizer(tokenizer_dir)


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def write_data(kind: str, root: Path, name: str, seed: int) -> tuple[Path, list[str]]:
    """A data set of `kind` and the options `atomc train` needs to read it (`--tokenizer`:
    followed by the tokenizer's directory)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 256, 4000)
    if kind == "bin-dtype":
        path = root / f"{name}.bin"
        ids.astype(np.uint16).tofile(path)
        return path, ["--data-dtype", "uint16"]
    if kind == "bin-sidecar":
        path = root / f"{name}.bin"
        ids.astype(np.uint32).tofile(path)
        (root / f"{name}.bin.json").write_text('{"dtype": "uint32"}')
        return path, []
    if kind == "npy":
        path = root / f"{name}.npy"
        np.save(path, ids.astype(np.int32))
        return path, []
    if kind == "bytes":
        path = root / f"{name}.txt"
        path.write_text("\n".join(documents(200, seed)))
        return path, []
    if kind == "text":
        path = root / f"{name}.txt"
        path.write_text("\n".join(documents(200, seed)))
        return path, ["--tokenizer"]
    if kind == "jsonl":
        return write_jsonl(root / f"{name}.jsonl", documents(200, seed), "body"), [
            "--tokenizer", "--text-field", "body"]
    datasets = pytest.importorskip("datasets")
    path = root / name
    if kind == "dataset-ids":
        rows = [rng.integers(0, 256, int(rng.integers(5, 60))).tolist() for _ in range(150)]
        datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(path))
        return path, []
    assert kind == "dataset-text"
    split = "train" if name == "train" else "validation"
    datasets.DatasetDict({split: datasets.Dataset.from_dict({"text": documents(200, seed)})}
                         ).save_to_disk(str(path))
    return path, ["--tokenizer"]


def train(args: list[str], capsys) -> tuple[int, str, str]:
    rc = atomc_main(["train", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def records(log_dir: Path, kind: str) -> list[dict]:
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def one_line_error(rc: int, err: str) -> str:
    """The one line of a refusal (beside the progress bar, when training had started)."""
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("training:")]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("atomc train: error: "), err
    assert "Traceback" not in err
    return lines[0]


FORMATS = ["bin-dtype", "bin-sidecar", "npy", "bytes", "text", "jsonl", "dataset-ids",
           "dataset-text"]


@pytest.mark.parametrize("kind", FORMATS)
def test_each_format_trains_with_a_held_out_loss(kind, tmp_path, tokenizer_dir, capsys):
    train_path, extra = write_data(kind, tmp_path, "train", seed=1)
    eval_path, _ = write_data(kind, tmp_path, "val", seed=2)
    extra = [a for e in extra for a in ([e, str(tokenizer_dir)] if e == "--tokenizer" else [e])]
    logs = tmp_path / "logs"
    rc, out, err = train([str(GPT_SPLIT), "--steps", "2", "--device", "cpu",
                          "--data", str(train_path), "--eval-data", str(eval_path),
                          "--eval-batches", "2", "--log-dir", str(logs), *extra], capsys)
    assert rc == 0, err
    assert "step 2: eval loss" in err + out
    steps = records(logs, "train")
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in steps)
    assert [r["tokens"] for r in steps] == [64, 128]
    for r in steps:  # every field of the record is measured
        assert r["lr"] == pytest.approx(1e-3) and r["grad_norm"] > 0 and r["tokens_per_s"] > 0
        assert 0 < r["device_busy"] <= 1 and r["step_ms"] > 0
    (ev,) = records(logs, "eval")
    assert ev["step"] == 2 and math.isfinite(ev["loss"])
    # on random ids, a model of 256 ids starts near ln 256; on text, it is what it is
    assert ev["loss"] == pytest.approx(math.log(256), rel=0.2)


def expected_ids(kind: str, path: Path, tokenizer) -> np.ndarray:
    """What each format holds, as ids, read plainly (the whole file at once)."""
    if kind == "bin-dtype":
        return np.fromfile(path, dtype=np.uint16).astype(np.int64)
    if kind == "bin-sidecar":
        return np.fromfile(path, dtype=np.uint32).astype(np.int64)
    if kind == "npy":
        return np.load(path).astype(np.int64)
    if kind == "bytes":
        return np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.int64)
    if kind == "text":
        return np.asarray(tokenizer(path.read_text(), add_special_tokens=False)["input_ids"])
    eos = tokenizer.eos_token_id
    if kind == "jsonl":
        docs = [json.loads(ln)["body"] for ln in path.read_text().splitlines()]
    else:
        import datasets
        ds = datasets.load_from_disk(str(path))
        if kind == "dataset-ids":
            return np.concatenate([np.asarray(r) for r in ds["input_ids"]])
        docs = ds["train"]["text"]
    return np.concatenate([np.asarray([*tokenizer(d)["input_ids"], eos]) for d in docs])


@pytest.mark.parametrize("kind", FORMATS)
def test_packed_batches_are_the_data_in_order_and_resume_exactly(kind, tmp_path, tokenizer,
                                                                 tokenizer_dir, monkeypatch):
    """Batches are the data's ids in order, wrapping round at its end; a position taken
    anywhere and resumed in a fresh reader gives the same batches as reading on. Pieces are
    made small, so that sequences cross pieces and text blocks."""
    monkeypatch.setattr(data_sources, "CHUNK", 100)
    monkeypatch.setattr(data_sources, "TEXT_BLOCK", 300)
    monkeypatch.setattr(data_sources, "DOC_BATCH", 7)
    path, extra = write_data(kind, tmp_path, "train", seed=3)
    tok = tokenizer if "--tokenizer" in extra else None
    field = "body" if kind == "jsonl" else "text"
    dtype = "uint16" if kind == "bin-dtype" else None

    def source():
        return open_source(str(path), dtype=dtype, tokenizer=tok, text_field=field)

    want = expected_ids(kind, path, tokenizer)
    data = PackedBatches(source(), ROWS, SEQ)
    n = -(-2 * len(want) // (ROWS * SEQ))  # past the end: the data wraps round
    got = [data.next() for _ in range(n)]
    flat = torch.cat([b.reshape(-1) for b in got]).numpy()
    assert np.array_equal(flat, np.resize(want, len(flat)))
    assert data.stream.epoch >= 1

    # resume from positions within the first epoch and across its end
    for cut in (1, n // 3, n // 2 + 1):
        first = PackedBatches(source(), ROWS, SEQ)
        for _ in range(cut):
            first.next()
        saved = json.loads(json.dumps(first.position()))  # as a checkpoint keeps it
        again = PackedBatches(source(), ROWS, SEQ)
        assert again.resume(saved).startswith("data: continuing")
        for k in range(cut, min(cut + 4, n)):
            assert torch.equal(again.next(), got[k])


def test_a_resumed_run_sees_the_batches_of_an_uninterrupted_one(tmp_path, tokenizer_dir,
                                                                capsys):
    """Four steps at once and two plus two from a checkpoint: the same losses, step for step,
    and the same weights (JSONL through a tokenizer: documents, end-of-text ids)."""
    data = write_jsonl(tmp_path / "d.jsonl", documents(120, seed=4))
    common = ["--device", "cpu", "--data", str(data), "--tokenizer", str(tokenizer_dir)]
    whole, part = tmp_path / "whole", tmp_path / "part"
    ckpt_whole, ckpt = tmp_path / "w.pt", tmp_path / "c.pt"
    assert train([str(GPT_SPLIT), "--steps", "4", *common, "--log-dir", str(whole),
                  "--checkpoint", str(ckpt_whole)], capsys)[0] == 0
    assert train([str(GPT_SPLIT), "--steps", "2", *common, "--log-dir", str(part),
                  "--checkpoint", str(ckpt)], capsys)[0] == 0
    with open(part / "metrics.jsonl", "a") as f:  # the tail of a run that crashed after step 2
        f.write('{"kind": "train", "step": 3, "loss": 9.0, "tokens": 0}\n{"kind": "tra')
    rc, out, err = train([str(GPT_SPLIT), "--steps", "4", *common, "--log-dir", str(part),
                          "--checkpoint", str(ckpt), "--resume", str(ckpt)], capsys)
    assert rc == 0, err
    assert "data: continuing" in out and "at token 128" in out
    a = [(r["step"], r["loss"], r["tokens"]) for r in records(whole, "train")]
    b = [(r["step"], r["loss"], r["tokens"]) for r in records(part, "train")]
    assert a == b  # the resumed run dropped the crashed tail and recorded steps 3 and 4
    from atomc.runtime.checkpoint import load_checkpoint
    sa, sb = load_checkpoint(ckpt_whole), load_checkpoint(ckpt)
    assert sa["data_position"] == sb["data_position"]
    assert all(torch.equal(x, y) for x, y in zip(sa["masters"], sb["masters"]))

    # other data than the checkpoint's: it starts at its beginning, and says so
    other = write_jsonl(tmp_path / "other.jsonl", documents(50, seed=5))
    rc, out, _ = train([str(GPT_SPLIT), "--steps", "5", "--device", "cpu", "--data",
                        str(other), "--tokenizer", str(tokenizer_dir), "--resume", str(ckpt)],
                       capsys)
    assert rc == 0 and "data position is in other data" in out


def test_the_readers_stream(tmp_path, tokenizer, monkeypatch):
    """A batch tokenizes the documents it needs and a few more, not the file; a token file
    is a memory map, read a piece at a time."""
    path = write_jsonl(tmp_path / "big.jsonl", documents(2000, seed=6))
    calls = []
    real = data_sources._encode_documents

    def counting(tok, texts):
        calls.append(len(texts))
        return real(tok, texts)

    monkeypatch.setattr(data_sources, "_encode_documents", counting)
    source = open_source(str(path), tokenizer=tokenizer)  # reads its first piece: a check
    calls.clear()
    data = PackedBatches(source, ROWS, SEQ)
    data.next()
    assert sum(calls) == data_sources.DOC_BATCH
    tokens = tmp_path / "t.bin"
    np.arange(3 * data_sources.CHUNK, dtype=np.uint32).tofile(tokens)
    src = open_source(str(tokens), dtype="uint32")
    pieces = src.pieces(0)
    start, first = next(pieces)
    assert start == 0 and len(first) == data_sources.CHUNK
    assert next(src.pieces(2 * data_sources.CHUNK))[1][0] == 2 * data_sources.CHUNK


# ---- bad input: one line each ------------------------------------------------------------------


def test_bad_input_is_one_line(tmp_path, tokenizer_dir, capsys):
    pkg = str(GPT_SPLIT)
    text = tmp_path / "t.txt"
    text.write_text("some text\n")
    err = one_line_error(*train([pkg, "--steps", "1", "--data", str(text), "--tokenizer",
                                 str(tmp_path / "no-such-tokenizer")], capsys)[::2])
    assert "no-such-tokenizer does not exist" in err and "nothing is downloaded" in err

    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02\x00\x03")
    err = one_line_error(*train([pkg, "--steps", "1", "--data", str(odd), "--data-dtype",
                                 "uint16"], capsys)[::2])
    assert "has 5 bytes, not a multiple of 2 (uint16 token ids)" in err

    config = tmp_path / "run.toml"
    config.write_text('steps = 2\nlearning_rate = 3e-4\n')
    err = one_line_error(*train([pkg, "--config", str(config)], capsys)[::2])
    assert "unknown key 'learning_rate'" in err
    assert "the keys are " in err and " lr, " in err and "steps" in err and "data_dtype" in err

    for body, expect in [('lr = "fast"', "lr = 'fast'"), ("steps = true", "steps = True"),
                         ('activations = "some"', "one of auto, recompute, keep"),
                         ("steps = [", "is not TOML")]:
        config.write_text(body + "\n")
        assert expect in one_line_error(*train([pkg, "--config", str(config)], capsys)[::2])

    no_dtype = tmp_path / "plain.bin"
    np.arange(10, dtype=np.uint16).tofile(no_dtype)
    err = one_line_error(*train([pkg, "--steps", "1", "--data", str(no_dtype)], capsys)[::2])
    assert "give --data-dtype" in err

    jsonl = write_jsonl(tmp_path / "d.jsonl", ["a b"])
    err = one_line_error(*train([pkg, "--steps", "1", "--data", str(jsonl)], capsys)[::2])
    assert "give the tokenizer" in err
    err = one_line_error(*train([pkg, "--steps", "1", "--data", str(jsonl), "--tokenizer",
                                 str(tokenizer_dir), "--text-field", "body"], capsys)[::2])
    assert "no text field 'body' (it has text, id)" in err

    # an option the data's format does not read, and data shorter than one sequence
    notes = tmp_path / "notes.json"
    notes.write_text('{"note": "' + "x" * 200 + '"}\n')
    err = one_line_error(*train([pkg, "--steps", "1", "--data", str(notes), "--data-dtype",
                                 "uint16"], capsys)[::2])
    assert "--data-dtype is read only for a flat token-id file" in err
    assert "notes.json as text" in err and "--data-format" in err
    with pytest.raises(UsageError, match="--text-field is read only for JSONL"):
        open_source(str(notes), text_field="body")
    np.arange(200, dtype=np.uint16).tofile(tmp_path / "ids.bin")
    err = one_line_error(*train([pkg, "--steps", "1", "--data", str(tmp_path / "ids.bin"),
                                 "--data-dtype", "uint16", "--tokenizer", str(tokenizer_dir)],
                                capsys)[::2])
    assert "--tokenizer is read only for text" in err
    short = tmp_path / "short.txt"
    short.write_bytes(b"12345678")
    err = one_line_error(*train([pkg, "--steps", "1", "--data", str(short)], capsys)[::2])
    assert "holds 8 token ids, fewer than one sequence of the plan" in err

    err = one_line_error(*train([pkg, "--steps", "1", "--eval-every", "2"], capsys)[::2])
    assert "--eval-every evaluates on --eval-data" in err
    err = one_line_error(*train(["--steps", "1"], capsys)[::2])
    assert "give the package directory" in err
    err = one_line_error(*train([pkg], capsys)[::2])
    assert "give the number of steps" in err


def test_ids_the_model_cannot_look_up_are_one_line(tmp_path, capsys):
    """Checked before they reach the model (on a GPU an out-of-range id is a device-side
    assertion): a token id, a byte, a tokenizer with more ids than the model."""
    assert model_vocabulary(load_swap_package(GPT_SPLIT)) == 256
    tokens = tmp_path / "t.bin"
    ids = np.full(200, 7, dtype=np.uint16)
    ids[150] = 300
    ids.tofile(tokens)
    rc, _, err = train([str(GPT_SPLIT), "--steps", "4", "--device", "cpu", "--data",
                        str(tokens), "--data-dtype", "uint16"], capsys)
    assert "token id 300 is outside the vocabulary of" in one_line_error(rc, err)
    assert "(0-255, 256 ids)" in err
    big = make_tokenizer(tmp_path / "bytes-tok", 300, byte_level=True)
    text = tmp_path / "t.txt"
    text.write_text("\n".join(documents(20, seed=8)))
    rc, _, err = train([str(GPT_SPLIT), "--steps", "1", "--device", "cpu", "--data",
                        str(text), "--tokenizer", str(big)], capsys)
    assert "its tokenizer has 300 ids" in one_line_error(rc, err)


def test_settings_file_with_command_line_over_it(tmp_path, capsys):
    """Every option of `atomc train` may be a key (the parser's own list); flags win."""
    tokens = tmp_path / "t.bin"
    np.random.default_rng(0).integers(0, 256, 2000).astype(np.uint16).tofile(tokens)
    logs = tmp_path / "logs"
    config = tmp_path / "run.toml"
    config.write_text(f'package = "{GPT_SPLIT}"\nsteps = 3\nlr = 0.01\nweight-decay = 0.0\n'
                      f'device = "cpu"\ndata = "{tokens}"\ndata_dtype = "uint16"\n'
                      f'log_dir = "{logs}"\nlog_every = 2\n')
    rc, _, err = train(["--config", str(config), "--lr", "0.02"], capsys)
    assert rc == 0, err
    steps = records(logs, "train")
    assert [r["step"] for r in steps] == [2, 3]  # every 2 steps, and the last
    assert all(r["lr"] == pytest.approx(0.02) for r in steps)
    (run,) = records(logs, "run")
    assert run["steps"] == 3 and run["tokens_per_step"] == ROWS * SEQ


def test_tensorboard_record(tmp_path, capsys, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tokens = tmp_path / "t.npy"
    np.save(tokens, np.random.default_rng(1).integers(0, 256, 3000))
    logs = tmp_path / "tb"
    rc, _, err = train([str(GPT_SPLIT), "--steps", "2", "--device", "cpu", "--data",
                        str(tokens), "--eval-data", str(tokens), "--eval-batches", "1",
                        "--log-dir", str(logs), "--tensorboard"], capsys)
    assert rc == 0, err
    events = EventAccumulator(str(logs))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s",
            "train/device_busy", "eval/loss"} <= tags
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2]

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    err = one_line_error(*train([str(GPT_SPLIT), "--steps", "1", "--log-dir", str(logs),
                                 "--tensorboard"], capsys)[::2])
    assert "--tensorboard needs the tensorboard package" in err


# ---- the runtime's side: held-out loss, gradient norm ------------------------------------------


def test_eval_loss_is_the_plain_models_and_changes_nothing():
    """The held-out loss is the unpartitioned model's loss in eval mode (dropout off), and a
    step after it is the step without it."""
    sys.path.insert(0, str(REPO / "examples"))
    import gpt
    torch.manual_seed(0)
    model = gpt.build_model("tiny-dropout").eval()
    g = torch.Generator().manual_seed(0)
    batch, nxt = (torch.randint(0, 256, (ROWS, SEQ), generator=g) for _ in range(2))
    with torch.no_grad():
        plain = sum(float(gpt.loss_fn(model(mb), (mb,))) for mb in batch.chunk(2)) / 2

    a = SwapTrainer.from_package(GPT_SPLIT, device="cpu")
    b = SwapTrainer.from_package(GPT_SPLIT, device="cpu")
    try:
        assert eval_loss(a, batch) == pytest.approx(plain, rel=1e-6)
        assert a.step(nxt) == b.step(nxt)
        assert all(torch.equal(a.store.read_master(i), b.store.read_master(i))
                   for i in range(len(a.store.layouts)))
        assert eval_loss(a, batch) == eval_loss(b, batch)
    finally:
        a.close()
        b.close()


def test_gradient_norm_without_clipping_is_the_clipping_norm():
    """The record's gradient norm of an unclipped run is the norm clipping would take."""
    batch = torch.randint(0, 256, (ROWS, SEQ), generator=torch.Generator().manual_seed(2))
    eager = SwapTrainer.from_package(GPT_SPLIT, device="cpu")
    clipped = SwapTrainer.from_package(GPT_SPLIT, device="cpu",
                                       optimizer={"max_grad_norm": 1e9})
    try:
        eager.step(batch)
        clipped.step(batch)
        norm = eager.optimizer.step_grad_norm()
        assert norm > 0 and norm == clipped.optimizer.step_grad_norm()
    finally:
        eager.close()
        clipped.close()


def test_token_input_and_held_out(tmp_path):
    pkg = load_swap_package(GPT_SPLIT)
    assert token_input(pkg) == ("idx", [2, SEQ], torch.int64)
    tokens = tmp_path / "short.bin"
    np.arange(ROWS * SEQ * 2 + 5, dtype=np.uint16).tofile(tokens)
    src = open_source(str(tokens), dtype="uint16")
    assert len(held_out(src, ROWS, SEQ, 5)) == 2  # what fits before the data ends
    with pytest.raises(UsageError, match="fewer token ids than one batch"):
        held_out(src, ROWS * 4, SEQ, 1)

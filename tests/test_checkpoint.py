"""Run directories: round trips, tied weights, atomic writes, and errors a person can act on."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from gptkiln.checkpoint import (
    PREVIOUS_STATE_FILE,
    TRAINER_STATE_FILE,
    atomic_write,
    check_same_model_config,
    read_checkpoint,
    save_model,
    write_checkpoint,
)
from gptkiln.config import GPTConfig
from gptkiln.errors import GptkilnError
from gptkiln.loading import CONFIG_FILE, WEIGHTS_FILE, load_model, load_run
from gptkiln.model import GPT
from gptkiln.run_guard import check_run_dir_for_training


def tiny_config(**overrides) -> GPTConfig:
    return GPTConfig(
        **{**dict(vocab_size=50, context_length=16, n_layer=2, n_head=2, n_embd=16), **overrides}
    )


def tiny_model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(tiny_config(**overrides)).eval()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    save_model(tiny_model(), tmp_path / "run")
    return tmp_path / "run"


@pytest.mark.parametrize("tied", [True, False])
def test_round_trip_gives_equal_tensors_and_logits(tmp_path, tied):
    model = tiny_model(tie_embeddings=tied, qkv_bias=not tied)
    save_model(model, tmp_path, train_config={"lr": 1e-3})
    loaded = load_model(tmp_path)
    assert loaded.config == model.config
    expected, got = model.state_dict(), loaded.state_dict()
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)
    idx = torch.randint(0, 50, (2, 10))
    torch.testing.assert_close(loaded(idx), model(idx), rtol=0, atol=0)
    cfg = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert cfg["format"] == 1 and cfg["train"] == {"lr": 1e-3}
    assert cfg["model"] == model.config.to_dict()


def test_tied_head_is_stored_once_and_shared_after_load(run_dir):
    from safetensors import safe_open

    with safe_open(run_dir / WEIGHTS_FILE, framework="pt") as f:
        assert "wte.weight" in f.keys() and "lm_head.weight" not in f.keys()
        assert f.metadata()["format"] == "pt" and "gptkiln_version" in f.metadata()
    model = load_model(run_dir)
    assert model.lm_head.weight is model.wte.weight
    with torch.no_grad():
        model.wte.weight[0, 0] = 123.0
    assert model.lm_head.weight[0, 0] == 123.0


def test_untied_head_stays_separate(tmp_path):
    save_model(tiny_model(tie_embeddings=False), tmp_path)
    model = load_model(tmp_path)
    assert model.lm_head.weight is not model.wte.weight
    assert not torch.equal(model.lm_head.weight, model.wte.weight)


@pytest.mark.parametrize("tied", [True, False])
def test_loaded_model_has_no_meta_tensors(tmp_path, tied):
    save_model(tiny_model(tie_embeddings=tied), tmp_path)
    for kwargs in ({}, {"dtype": torch.bfloat16}):
        model = load_model(tmp_path, **kwargs)
        tensors = list(model.parameters()) + list(model.buffers())
        assert tensors and not any(t.is_meta for t in tensors)
        assert all(t.device.type == "cpu" for t in tensors)
        assert model.wte.weight.dtype == kwargs.get("dtype", torch.float32)
        assert (model.lm_head.weight is model.wte.weight) is tied
    model = load_model(tmp_path)
    out = model(torch.zeros(1, 4, dtype=torch.long))
    assert out.shape == (1, 4, 50) and torch.isfinite(out).all()


def test_load_accepts_the_weights_file_or_config_path(run_dir):
    reference = load_model(run_dir).state_dict()
    for path in (run_dir / WEIGHTS_FILE, run_dir / CONFIG_FILE):
        got = load_model(path).state_dict()
        assert all(torch.equal(got[k], reference[k]) for k in reference)


def test_save_unwraps_a_compiled_or_ddp_style_wrapper(tmp_path):
    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    model = tiny_model()
    save_model(Wrapper(model), tmp_path)
    assert torch.equal(load_model(tmp_path).h[0].attn.c_attn.weight, model.h[0].attn.c_attn.weight)


def test_atomic_write_keeps_the_old_file_when_write_fn_fails(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"old contents")

    def half_write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(b"new con")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(path, half_write)
    assert path.read_bytes() == b"old contents"
    assert os.listdir(tmp_path) == ["model.safetensors"]  # no temp file left behind
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(b"new contents"))
    assert path.read_bytes() == b"new contents"
    assert os.listdir(tmp_path) == ["model.safetensors"]


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                     'message: "No space left on device" })'),
    ],
)  # fmt: skip
def test_a_full_disk_is_one_line_and_keeps_the_old_file(tmp_path, error):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"old contents")

    def fill_the_disk(tmp: str) -> None:
        Path(tmp).write_bytes(b"new con")
        raise error

    with pytest.raises(GptkilnError, match="no space left on the device writing .*--resume"):
        atomic_write(path, fill_the_disk)
    assert path.read_bytes() == b"old contents" and os.listdir(tmp_path) == ["model.safetensors"]


def test_a_writer_that_keeps_no_errno_is_read_by_the_free_space_left(tmp_path, monkeypatch):
    """torch.save's stream writer on a full disk says only "unexpected pos" (and NumPy's tofile
    "N requested and M written"): with under 1 MiB free, that is a full disk, in one line; with
    room left (a file size limit, a quota), a write that failed, in one line too."""
    import shutil

    path = tmp_path / "trainer_state.pt"
    path.write_bytes(b"old state")

    def torch_full(tmp: str) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1024")

    free = {"bytes": 4096}
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda d: usage._replace(free=free["bytes"]))
    with pytest.raises(GptkilnError, match="no space left on the device writing"):
        atomic_write(path, torch_full)
    free["bytes"] = 10 << 30
    with pytest.raises(GptkilnError, match=r"could not write .*unexpected pos.*ulimit -f"):
        atomic_write(path, torch_full)
    assert path.read_bytes() == b"old state"
    free["bytes"] = 4096

    def denied(tmp: str) -> None:  # an errno of its own: not a full disk, however little is left
        raise PermissionError(errno.EACCES, "Permission denied")

    with pytest.raises(PermissionError):
        atomic_write(path, denied)
    assert path.read_bytes() == b"old state" and os.listdir(tmp_path) == [path.name]


def test_a_full_disk_under_a_write_without_a_path_is_one_line(tmp_path, monkeypatch, capsys):
    """An ENOSPC that names no file (a metrics row appended, a log) is the CLI's one line."""
    from gptkiln.cli import info, main

    def full(args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(info, "run", full)
    assert main(["info", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no space left on the device" in err and len(err.splitlines()) == 1


def test_failed_save_leaves_the_previous_checkpoint_loadable(run_dir, monkeypatch):
    before = load_model(run_dir).state_dict()

    def fail(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr("gptkiln.checkpoint.save_file", fail)
    with pytest.raises(GptkilnError, match="no space left"):
        save_model(tiny_model(seed=1), run_dir)
    after = load_model(run_dir).state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("keep", [0.5, 0.99, 20])
def test_truncated_weights_are_reported(run_dir, keep):
    path = run_dir / WEIGHTS_FILE
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)] if keep < 1 else data[:keep])
    with pytest.raises(GptkilnError, match="truncated") as info:
        load_model(run_dir)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and "re-run training" in message


def test_foreign_safetensors_names_the_bad_keys(run_dir):
    sd = load_model(run_dir).state_dict()
    sd.pop("lm_head.weight")
    sd["transformer.wte.weight"] = sd.pop("wte.weight")
    sd["h.0.mlp.c_fc.weight"] = torch.zeros(3, 3)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(run_dir / WEIGHTS_FILE))
    with pytest.raises(GptkilnError) as info:
        load_model(run_dir)
    message = str(info.value)
    assert "missing wte.weight" in message
    assert "unexpected transformer.wte.weight" in message
    assert "h.0.mlp.c_fc.weight (3, 3) (expected (64, 16))" in message
    assert "\n" not in message
    sd.update({f"extra.{i}": torch.zeros(1) for i in range(10)})  # a long list is cut short
    save_file({k: v.contiguous() for k, v in sd.items()}, str(run_dir / WEIGHTS_FILE))
    with pytest.raises(GptkilnError, match=r"unexpected (extra\.\d+, ){5}extra\.\d+ and 5 more"):
        load_model(run_dir)


def test_not_a_run_directory(tmp_path):
    with pytest.raises(GptkilnError, match="config.json is missing.*gptkiln train --out"):
        load_model(tmp_path)
    with pytest.raises(GptkilnError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_missing_weights_file(run_dir):
    (run_dir / WEIGHTS_FILE).unlink()
    with pytest.raises(GptkilnError, match="model.safetensors is missing"):
        load_model(run_dir)


def test_invalid_config_json(run_dir):
    (run_dir / CONFIG_FILE).write_text('{"format": 1, "model": {')
    with pytest.raises(GptkilnError, match="config.json is not valid JSON"):
        load_model(run_dir)


def test_newer_format_is_refused(run_dir):
    cfg = json.loads((run_dir / CONFIG_FILE).read_text())
    (run_dir / CONFIG_FILE).write_text(json.dumps({**cfg, "format": 99}))
    with pytest.raises(GptkilnError, match="upgrade gptkiln"):
        load_model(run_dir)


def test_load_run_returns_the_saved_tokenizer(tmp_path):
    from gptkiln.tokenizers import build_char_tokenizer

    tokenizer = build_char_tokenizer(["hello world"], with_eot=True)
    model = tiny_model(vocab_size=tokenizer.vocab_size)
    save_model(model, tmp_path, train_config={"tokenizer": "char"}, tokenizer=tokenizer)
    loaded, loaded_tok, cfg = load_run(tmp_path)
    assert loaded_tok.kind == "char" and loaded_tok.encode("hello") == tokenizer.encode("hello")
    assert cfg["tokenizer"] == "char" and cfg["train"] == {"tokenizer": "char"}
    assert loaded.config == model.config
    assert not any(name.startswith(".") for name in os.listdir(tmp_path))


# -- training checkpoints --------------------------------------------------------------------
def _trained_state(model: GPT):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _, loss = model(torch.randint(0, 50, (2, 8)), torch.randint(0, 50, (2, 8)))
    loss.backward()
    optimizer.step()
    return {"step": 7, "optimizer": optimizer.state_dict(), "rng": [torch.get_rng_state()]}


def test_write_and_read_checkpoint(tmp_path):
    model = tiny_model()
    state = _trained_state(model)
    write_checkpoint(tmp_path, model.config, model.state_dict(), state, train_config={"a": 1})
    sd, got = read_checkpoint(tmp_path)
    assert sd.keys() == model.state_dict().keys()
    assert sd["lm_head.weight"] is sd["wte.weight"]
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())
    assert got["step"] == 7 and torch.equal(got["rng"][0], state["rng"][0])
    exp_avg = state["optimizer"]["state"][0]["exp_avg"]
    assert torch.equal(got["optimizer"]["state"][0]["exp_avg"], exp_avg)
    fresh = tiny_model(seed=5)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.h[1].mlp.c_fc.weight, model.h[1].mlp.c_fc.weight)


def test_read_checkpoint_detects_weights_and_state_of_different_saves(tmp_path):
    model = tiny_model()
    state = _trained_state(model)
    write_checkpoint(tmp_path, model.config, model.state_dict(), state)
    torch.save({**state, "step": 9}, tmp_path / TRAINER_STATE_FILE)
    with pytest.raises(GptkilnError, match="step 7 but trainer_state.pt from step 9"):
        read_checkpoint(tmp_path)
    (tmp_path / TRAINER_STATE_FILE).write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(GptkilnError, match="trainer_state.pt is truncated or corrupt"):
        read_checkpoint(tmp_path)
    for garbage, said in ((b"garbage" * 10, "not a trainer state"),
                          (None, "names objects that no trainer state holds")):  # fmt: skip
        if garbage is None:
            torch.save({**state, "path": Path("/")}, tmp_path / TRAINER_STATE_FILE)
        else:
            (tmp_path / TRAINER_STATE_FILE).write_bytes(garbage)
        with pytest.raises(GptkilnError, match=said) as caught:
            read_checkpoint(tmp_path)
        assert "weights_only" not in str(caught.value)  # torch's advice to load it unsafely


def test_a_crash_between_the_files_of_a_save_leaves_a_resumable_pair(tmp_path, monkeypatch):
    model = tiny_model()
    state = _trained_state(model)
    write_checkpoint(tmp_path, model.config, model.state_dict(), state)
    old_weights = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.h[0].mlp.c_fc.weight.add_(1.0)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # the process dies after the trainer state, before the weights

    monkeypatch.setattr("gptkiln.checkpoint.write_safetensors", killed)
    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(tmp_path, model.config, model.state_dict(), {**state, "step": 12})
    assert (tmp_path / TRAINER_STATE_FILE).is_file() and (tmp_path / PREVIOUS_STATE_FILE).is_file()
    sd, got = read_checkpoint(tmp_path)
    assert got["step"] == 7  # the state that goes with the weights on disk
    assert torch.equal(sd["h.0.mlp.c_fc.weight"], old_weights["h.0.mlp.c_fc.weight"])
    check_run_dir_for_training(tmp_path, resume=True, overwrite=False)
    # The resumed run's next save is cut short too: the step-7 pair must survive that as well.
    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(tmp_path, model.config, model.state_dict(), {**state, "step": 17})
    assert read_checkpoint(tmp_path)[1]["step"] == 7
    monkeypatch.undo()
    write_checkpoint(tmp_path, model.config, model.state_dict(), {**state, "step": 12})
    assert not (tmp_path / PREVIOUS_STATE_FILE).exists()
    sd, got = read_checkpoint(tmp_path)
    assert got["step"] == 12 and torch.equal(sd["h.0.mlp.c_fc.weight"], model.h[0].mlp.c_fc.weight)


def test_loading_builds_on_the_meta_device_and_draws_no_weights(run_dir, monkeypatch):
    drawn_on = []
    normal_ = torch.nn.init.normal_

    def watched(tensor, *args, **kwargs):
        drawn_on.append(tensor.device.type)
        return normal_(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.nn.init, "normal_", watched)
    model = load_model(run_dir)
    assert drawn_on and set(drawn_on) == {"meta"}  # no memory filled, then thrown away
    assert not any(p.is_meta for p in model.parameters())


def test_a_directory_with_any_file_of_a_checkpoint_counts_as_one(tmp_path, run_dir):
    only_weights = tmp_path / "w"
    only_weights.mkdir()
    (only_weights / WEIGHTS_FILE).write_bytes((run_dir / WEIGHTS_FILE).read_bytes())
    only_prev = tmp_path / "p"
    only_prev.mkdir()
    (only_prev / PREVIOUS_STATE_FILE).write_bytes(b"state")
    with pytest.raises(GptkilnError, match="already holds a model .saved without a training"):
        check_run_dir_for_training(only_weights, resume=False, overwrite=False)
    for resume in (False, True):  # a first save cut short: nothing to resume, --overwrite
        with pytest.raises(GptkilnError, match="cut short .*pass --overwrite"):
            check_run_dir_for_training(only_prev, resume=resume, overwrite=False)
    check_run_dir_for_training(only_prev, resume=False, overwrite=True)


class _Note:  # any class of code: a trainer state holding one is refused, not executed
    pass


def test_trainer_state_is_read_as_plain_data_only(tmp_path):
    model = tiny_model()
    write_checkpoint(tmp_path, model.config, model.state_dict(), _trained_state(model))
    state = torch.load(tmp_path / TRAINER_STATE_FILE, weights_only=True)
    state["note"] = _Note()
    torch.save(state, tmp_path / TRAINER_STATE_FILE)
    with pytest.raises(GptkilnError, match="truncated or corrupt"):
        read_checkpoint(tmp_path)


def test_run_dir_checks_for_training(tmp_path, run_dir):
    check_run_dir_for_training(tmp_path / "new", resume=False, overwrite=False)
    with pytest.raises(
        GptkilnError, match="already holds a model .*cannot be resumed.*--overwrite"
    ):
        check_run_dir_for_training(run_dir, resume=False, overwrite=False)
    check_run_dir_for_training(run_dir, resume=False, overwrite=True)
    with pytest.raises(GptkilnError, match="cannot resume.*no trainer_state.pt"):
        check_run_dir_for_training(run_dir, resume=True, overwrite=False)
    with pytest.raises(GptkilnError, match="cannot resume.*no checkpoint"):
        check_run_dir_for_training(tmp_path / "new", resume=True, overwrite=False)
    check_same_model_config(run_dir, tiny_config())
    with pytest.raises(GptkilnError, match="n_layer 2 in the checkpoint, 3 now"):
        check_same_model_config(run_dir, tiny_config(n_layer=3))


# -- a config.json that does not fit its weights ---------------------------------------------
@pytest.mark.parametrize(
    "field, value, holds",
    [
        ("n_layer", 1_000_000_000, "n_layer 2"),
        ("n_embd", 64, "n_embd 16"),
        ("vocab_size", 50257, "vocab_size 50"),
        ("context_length", 1_000_000, "context_length 16"),
    ],
)
def test_a_config_edited_away_from_its_weights_is_refused_naming_the_field(
    run_dir, field, value, holds
):
    cfg = json.loads((run_dir / CONFIG_FILE).read_text())
    cfg["model"][field] = value
    if field == "n_embd":
        cfg["model"]["n_head"] = 4
    (run_dir / CONFIG_FILE).write_text(json.dumps(cfg))
    with pytest.raises(GptkilnError, match=f"says {field} {value}, but the weights hold {holds}"):
        load_model(run_dir)
    with pytest.raises(GptkilnError, match=f"says {field} {value}"):
        read_checkpoint(run_dir)  # resuming reads the same check


def test_expected_shapes_are_those_of_the_model_built(tmp_path):
    from gptkiln.loading import expected_shapes

    for overrides in ({}, {"qkv_bias": False, "tie_embeddings": False}, {"n_layer": 3}):
        config = tiny_config(**overrides)
        with torch.device("meta"):
            sd = GPT(config).state_dict()
        if config.tie_embeddings:
            sd.pop("lm_head.weight")
        assert list(expected_shapes(config).items()) == [(k, tuple(v.shape)) for k, v in sd.items()]


def test_integer_tensors_in_place_of_weights_are_refused(run_dir):
    from gptkiln.loading import read_safetensors

    sd = dict(read_safetensors(run_dir / WEIGHTS_FILE))
    sd["h.0.ln_1.weight"] = torch.ones(16, dtype=torch.int32)
    save_file(sd, run_dir / WEIGHTS_FILE)
    with pytest.raises(
        GptkilnError, match=r"not floating-point weights: h\.0\.ln_1\.weight \(int32\)"
    ):
        load_model(run_dir)


def test_a_huge_edited_config_is_one_line_from_the_cli_not_a_hang(run_dir):
    import subprocess
    import sys

    cfg = json.loads((run_dir / CONFIG_FILE).read_text())
    cfg["model"]["n_layer"] = 1_000_000_000
    (run_dir / CONFIG_FILE).write_text(json.dumps(cfg))
    (run_dir / "tokenizer_meta.json").write_text(
        '{"kind": "gpt2", "vocab_size": 50257, "eot_id": 50256}'
    )
    argv = [sys.executable, "-m", "gptkiln", "generate", str(run_dir), "--prompt", "hi"]
    # Before the check this ran past 60 s with gigabytes growing; the timeout is a hang guard.
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "says n_layer 1000000000, but the weights hold n_layer 2" in proc.stderr


def test_a_written_file_has_the_umasks_mode_or_the_mode_of_the_file_it_replaces(tmp_path):
    """atomic_write's temporary file is 0600 (mkstemp): the file it becomes is readable as any
    new file is under the umask (a run or an export shared with another user), and a file it
    replaces keeps its own mode."""
    from gptkiln.checkpoint import atomic_write

    def write(tmp):
        Path(tmp).write_text("x")

    def safetensors_write(tmp):  # it makes its file 0600 whatever the umask
        save_file({"x": torch.zeros(2)}, tmp)

    old = os.umask(0o027)
    try:
        atomic_write(tmp_path / "new.txt", write)
        assert (tmp_path / "new.txt").stat().st_mode & 0o777 == 0o640
        (tmp_path / "new.txt").chmod(0o600)
        atomic_write(tmp_path / "new.txt", write)
        assert (tmp_path / "new.txt").stat().st_mode & 0o777 == 0o600
        atomic_write(tmp_path / "model.safetensors", safetensors_write)
        assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(old)


def test_a_folder_it_may_not_write_in_is_named_not_the_temporary_file(tmp_path, monkeypatch):
    import gptkiln.checkpoint as checkpoint

    def refused(path):
        raise PermissionError(13, "Permission denied", str(path.with_name(".x.1234.tmp")))

    monkeypatch.setattr(checkpoint, "_new_temporary", refused)
    with pytest.raises(PermissionError) as caught:
        checkpoint.atomic_write(tmp_path / "out.gguf", lambda tmp: None)
    assert caught.value.filename == str(tmp_path) and ".tmp" not in str(caught.value)


def test_weights_this_user_may_not_read_are_named_so_not_corrupt(tmp_path, monkeypatch):
    import os

    from gptkiln.loading.files import read_safetensors

    save_file({"x": torch.zeros(2)}, tmp_path / "model.safetensors")
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if mode == os.R_OK else real(p, mode))
    monkeypatch.setattr(
        "safetensors.torch.load_file",
        lambda *a, **k: (_ for _ in ()).throw(OSError("No such file or directory (os error 2)")),
    )
    with pytest.raises(GptkilnError, match="this user may not read it"):
        read_safetensors(tmp_path / "model.safetensors")


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def test_an_overwrites_first_checkpoint_cut_short_never_costs_the_run_it_replaced(tmp_path):
    """A kill after the new run's trainer state but before its config.json: that is no
    checkpoint, so the replaced run stays in .replaced, and both a resume and a plain train
    say so, rather than drop it as a run that had saved."""
    from gptkiln.run_guard import REPLACED_DIR, set_aside_replaced

    model, run = tiny_model(), tmp_path / "run"
    write_checkpoint(run, model.config, model.state_dict(), _trained_state(model))
    before = _files(run)
    set_aside_replaced(run)
    torch.save({"step": 2}, run / TRAINER_STATE_FILE)  # the new run's first save, cut short
    for resume in (False, True):
        with pytest.raises(GptkilnError, match=r"\.replaced holds the run an --overwrite"):
            check_run_dir_for_training(run, resume=resume, overwrite=False)
    assert _files(run / REPLACED_DIR) == before
    set_aside_replaced(run)  # another --overwrite: the cut-short files go, the old run stays
    assert _files(run / REPLACED_DIR) == before and not (run / TRAINER_STATE_FILE).exists()


def test_a_set_aside_stopped_halfway_puts_the_run_back_whole(tmp_path):
    """A kill while an --overwrite moves the old run's files aside (into .replacing, which
    becomes .replaced only when every file is in): the next start moves them back."""
    from gptkiln.run_guard import SETTING_ASIDE_DIR

    model, run = tiny_model(), tmp_path / "run"
    write_checkpoint(run, model.config, model.state_dict(), _trained_state(model))
    before = _files(run)
    (run / SETTING_ASIDE_DIR).mkdir()
    for name in (WEIGHTS_FILE, CONFIG_FILE):  # the first files moved when the kill came
        os.replace(run / name, run / SETTING_ASIDE_DIR / name)
    check_run_dir_for_training(run, resume=True, overwrite=False)
    assert _files(run) == before and not (run / SETTING_ASIDE_DIR).exists()
    read_checkpoint(run)


def test_weights_no_training_wrote_take_no_trainer_state(tmp_path):
    """A conversion cut short over a run (`convert hf --out RUN --overwrite`) leaves its weights
    beside the old run's trainer state: they record no step, so a resume refuses them."""
    model, run = tiny_model(), tmp_path / "run"
    write_checkpoint(run, model.config, model.state_dict(), _trained_state(model))
    save_model(tiny_model(seed=1), run)  # the new weights; the old trainer state not yet gone
    with pytest.raises(GptkilnError, match="records no training step .* is not its"):
        read_checkpoint(run)


def test_a_rename_that_fails_names_the_file_it_was_to_be(tmp_path, monkeypatch):
    """Not the temporary file, gone by the time the message is read."""
    import gptkiln.checkpoint as checkpoint_module

    def refused(src, dst):
        raise PermissionError(errno.EPERM, "Operation not permitted", src, None, dst)

    monkeypatch.setattr(checkpoint_module.os, "replace", refused)
    with pytest.raises(PermissionError) as caught:
        atomic_write(tmp_path / "model.safetensors", lambda tmp: Path(tmp).write_bytes(b"x"))
    assert caught.value.filename == str(tmp_path / "model.safetensors")
    assert os.listdir(tmp_path) == []


def test_a_restore_stopped_halfway_is_finished_by_the_next_start(tmp_path):
    """The replaced run goes back through .restoring: a stop halfway leaves the rest there, and
    the next start moves it in, rather than take the files back so far for the whole run."""
    from gptkiln.run_guard import RESTORING_DIR

    model, run = tiny_model(), tmp_path / "run"
    write_checkpoint(run, model.config, model.state_dict(), _trained_state(model))
    (run / "metrics.csv").write_text("step,tokens\n4,32\n")
    before = _files(run)
    (run / RESTORING_DIR).mkdir()
    os.replace(run / "metrics.csv", run / RESTORING_DIR / "metrics.csv")  # not yet back
    check_run_dir_for_training(run, resume=True, overwrite=False)
    assert _files(run) == before and not (run / RESTORING_DIR).exists()


def test_two_processes_write_the_same_tensors_and_metadata_to_the_same_bytes(tmp_path):
    """safetensors writes ``__metadata__`` in a hash map's order, seeded anew in each process:
    `write_safetensors` sorts it, so that identical runs leave identical files."""
    import subprocess
    import sys

    script = (
        "import sys, torch\n"
        "from gptkiln.checkpoint import write_safetensors\n"
        "meta = {f'key{i}': str(i) for i in range(8)}\n"
        "write_safetensors(sys.argv[1], {'w': torch.arange(6.0)}, meta)\n"
    )
    files = [tmp_path / f"{i}.safetensors" for i in range(2)]  # 8! orders: 1 in 40,320 alike
    for path in files:
        subprocess.run([sys.executable, "-c", script, str(path)], check=True)
    assert files[0].read_bytes() == files[1].read_bytes()
    from safetensors import safe_open

    with safe_open(str(files[0]), "pt") as f:
        assert f.metadata() == {f"key{i}": str(i) for i in range(8)}


def test_taking_a_runs_lock_drops_the_temporaries_a_killed_save_left(tmp_path):
    """A save killed halfway (kill -9, a power cut) leaves its temporary file, a checkpoint's
    worth of disk; the next training run there deletes those of its own files, none other."""
    from gptkiln.run_guard import RunLock

    run = tmp_path / "run"
    run.mkdir()
    left = [run / ".model.safetensors.0a1b2c3d.tmp", run / ".trainer_state.pt.deadbeef.tmp"]
    others = [run / ".notes.txt.0a1b2c3d.tmp", run / "model.safetensors", run / ".x.tmp"]
    for path in left + others:
        path.write_bytes(b"partial")
    lock = RunLock(run)
    lock.acquire()
    try:
        assert not any(p.exists() for p in left) and all(p.exists() for p in others)
    finally:
        lock.release()


def test_a_trainer_state_that_cannot_be_written_says_which_checkpoint_is_kept(
    tmp_path, monkeypatch
):
    """A save whose trainer state fails (a file size limit) keeps the checkpoint before it, and
    says so (not "nothing was written"): the resume reads it."""
    model = tiny_model()
    state = _trained_state(model)
    write_checkpoint(tmp_path, model.config, model.state_dict(), state)

    def limited(obj, f, *args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1024")

    monkeypatch.setattr(torch, "save", limited)
    with pytest.raises(GptkilnError, match="the checkpoint of step 7 is kept") as e:
        write_checkpoint(tmp_path, model.config, model.state_dict(), {**state, "step": 12})
    assert "nothing was written" not in str(e.value)
    monkeypatch.undo()
    assert read_checkpoint(tmp_path)[1]["step"] == 7


def test_a_converted_models_out_no_file_can_be_made_in_is_refused_before_any_work():
    """A new --out under a folder no file can be made in (``/proc``; read-only alike) and an
    existing folder of that kind are one line naming the folder, before a model is loaded or
    downloaded (not a stage folder's failure after the work)."""
    from gptkiln.run_guard import check_out_dir

    for out in (Path("/proc/gptkiln-new-run"), Path("/proc/sys")):
        with pytest.raises(GptkilnError, match=r"--out /proc/\S+: cannot write in /proc"):
            check_out_dir(out, overwrite=False)


def test_an_output_under_a_file_is_refused_before_any_work(tmp_path):
    """A converted model's --out and a command's output file both name the file in their way."""
    from gptkiln.run_guard import check_out_dir, check_writable

    (tmp_path / "notes.txt").write_text("x")
    for check in (
        lambda p: check_out_dir(p, overwrite=False),
        lambda p: check_writable(p, "--out"),
    ):
        with pytest.raises(GptkilnError, match=r"notes\.txt is a file, not a folder"):
            check(tmp_path / "notes.txt" / "deeper" / "out")
    assert check_out_dir(tmp_path / "new" / "run", overwrite=False) == []
    assert not (tmp_path / "new").exists()

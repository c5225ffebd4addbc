"""`probe import` runs no code a dump holds, and a malformed dump of any format is one line and exit 2.

Payloads (a `__reduce__` to os.system, eval, subprocess.Popen, importlib.import_module, that would touch a
marker file) are planted where each pickled format holds objects; the fuzz test mutates the genuine dumps the
suite writes (tests/import_dumps.py), field by field, and asserts exit 0 or 2, no traceback, no marker, and
that `probe report` on what imports ends in 0 or one line and 2. Fixed, derandomized examples: the file
takes 45 s on a shared 2-core machine.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from import_dumps import (
    consolidated_batch,
    make_seqs,
    write_miles,
    write_nemo_rl,
    write_prime_rl,
    write_slime_train,
    write_verl_state,
)
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.errors import ProbeError
from mismatch_probe.importers.verl import _consolidated, load_batch, unpickle

pytestmark = pytest.mark.lane  # docs/development.md: the dependency lanes' subset

runner = CliRunner()
FIXTURE = Path(__file__).parent / "fixtures" / "import" / "verl_step1.pkl"
REFUSED = "refuses to load `{}` from a pickle (pickles run code); pass --trust-pickle if you trust this file"


class Payload:
    """Unpickled, it calls `call(*args)`: each of them would create the marker file (or import a module)."""

    def __init__(self, marker: Path, name: str = "posix.system"):
        self.call, self.args = {
            "posix.system": (os.system, (f"touch {marker}",)),
            "builtins.eval": (eval, (f"open({str(marker)!r}, 'w')",)),
            "subprocess.Popen": (subprocess.Popen, (["touch", str(marker)],)),
            "importlib.import_module": (importlib.import_module, ("this",)),
        }[name]

    def __reduce__(self):
        return self.call, self.args


def probe(*argv) -> object:
    return runner.invoke(app, [str(a) for a in argv])


def assert_one_line_or_fine(result, names: str) -> None:
    """Exit 0, or exit 2 with one line naming the dump; never an exception."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code in (0, 2), result.output
    assert "Traceback" not in result.output
    if result.exit_code == 2:
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {names}"), result.output


# ---- the genuine dumps, as structures a test can change and write ------------------------------


def _verl_parts():
    arrays, _ = load_batch(FIXTURE)
    with open(FIXTURE, "rb") as fh:
        _, non_tensor, meta = unpickle(fh, FIXTURE).state
    return arrays, non_tensor, meta


def write(fmt: str, root: Path, records: list, top: dict) -> Path:
    """The dump of `fmt` holding `records` (per-sample dicts; miles: one dict of columns; verl: one dict of
    batch arrays) and `top` (the file's other entries; verl: meta_info and non_tensor_batch)."""
    if fmt in ("prime-rl", "nemo-rl"):
        path = root / ("token_exports/step_1/rank_0.jsonl" if fmt == "prime-rl" else "train_data_step1.jsonl")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return root
    root.mkdir(parents=True, exist_ok=True)
    if fmt == "verl":
        return write_verl_state(root / "step_1.pkl", (consolidated_batch(records[0]), top["non_tensor"], top["meta"]))
    if fmt == "slime":
        torch.save({**top, "samples": records}, root / "3.pt")
    else:
        (root / "train_data").mkdir(exist_ok=True)
        torch.save({**top, "rollout_data": records[0]}, root / "train_data" / "1_0.pt")
    return root


def genuine(fmt: str, scratch: Path) -> tuple[list, dict]:
    """The records and top-level entries of the suite's genuine dump of `fmt`, read back from its writer."""
    seqs = make_seqs(n=3)
    if fmt == "verl":
        arrays, non_tensor, meta = _verl_parts()
        return [arrays], {"non_tensor": non_tensor, "meta": meta}
    if fmt == "slime":
        payload = torch.load(write_slime_train(scratch / "3.pt", seqs), weights_only=False)
        return payload.pop("samples"), payload
    if fmt == "miles":
        payload = torch.load(write_miles(scratch, seqs) / "train_data" / "1_0.pt", weights_only=False)
        return [payload.pop("rollout_data")], payload
    root = (write_prime_rl if fmt == "prime-rl" else write_nemo_rl)(scratch, seqs)
    (path,) = root.rglob("*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()], {}


FORMATS = ("verl", "slime", "miles", "prime-rl", "nemo-rl")


# ---- planted payloads ---------------------------------------------------------------------------


def _plant(where: str, root: Path, evil: Payload) -> tuple[str, Path]:
    fmt = where.split(":")[0]
    records, top = genuine(fmt, root / "genuine")
    if where == "slime:top":
        top["evil"] = evil
    elif where == "slime:sample":
        records[1]["metadata"] = {"note": [evil]}
    elif where == "miles:column":
        records[0]["log_probs"][1] = evil
    elif where == "verl:meta_info":
        top["meta"] = {**top["meta"], "timing": evil}
    elif where == "verl:non_tensor_batch":
        top["non_tensor"] = {**top["non_tensor"], "extra": np.array([evil, 1, 2], dtype=object)}
    elif where == "verl:batch":
        return fmt, write_verl_state(
            root / "dump" / "step_1.pkl", (_torch_saved({"x": evil}), top["non_tensor"], top["meta"])
        )
    return fmt, write(fmt, root / "dump", records, top)


def _torch_saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("where", "name"),
    [(w, "posix.system") for w in ("slime:top", "slime:sample", "miles:column", "verl:meta_info", "verl:batch")]
    + [("verl:non_tensor_batch", n) for n in ("posix.system", "builtins.eval", "subprocess.Popen")]
    + [("slime:sample", n) for n in ("builtins.eval", "importlib.import_module")],
)
def test_a_planted_payload_is_refused_and_never_runs(tmp_path, where, name):
    marker = tmp_path / "marker"
    fmt, dump = _plant(where, tmp_path, Payload(marker, name))
    result = probe("import", fmt, dump, "--out", tmp_path / "run")
    assert result.exit_code == 2, result.output
    (file,) = [dump] if dump.is_file() else [p for p in dump.rglob("*") if p.is_file()]
    assert result.output == f"error: {file}: {REFUSED.format(name)}\n"
    assert not marker.exists() and not (tmp_path / "run").exists()


def test_a_torchscript_archive_is_refused(tmp_path):
    scripted = torch.jit.script(torch.nn.Identity())
    torch.jit.save(scripted, tmp_path / "3.pt")
    result = probe("import", "slime", tmp_path / "3.pt", "--out", tmp_path / "run")
    assert result.exit_code == 2
    assert "3.pt: a TorchScript archive, which runs code when loaded; pass --trust-pickle" in result.output


def test_trust_pickle_reads_a_custom_class_and_the_manifest_says_so(tmp_path):
    records, top = genuine("verl", tmp_path / "genuine")
    top["meta"] = {**top["meta"], "ratio": Fraction(1, 3)}  # a class no writer emits
    dump = write("verl", tmp_path / "dump", records, top)
    refused = probe("import", "verl", dump, "--out", tmp_path / "run")
    assert refused.exit_code == 2 and REFUSED.format("fractions.Fraction") in refused.output
    trusted = probe("import", "verl", dump, "--out", tmp_path / "run", "--trust-pickle")
    assert trusted.exit_code == 0, trusted.output
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["source"]["trust_pickle"] is True


def test_the_command_line_refuses_a_payload_in_one_line_on_stderr(tmp_path):
    marker = tmp_path / "marker"
    _, dump = _plant("slime:sample", tmp_path, Payload(marker))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run(
        [sys.executable, "-m", "mismatch_probe", "import", "slime", str(dump), "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"error: {dump / '3.pt'}: {REFUSED.format('posix.system')}\n"
    assert not marker.exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("dtype", ["_dynamo", "onnx", "load", 7])
def test_a_leaf_dtype_is_looked_up_in_torch_never_through_its_lazy_getattr(monkeypatch, dtype):
    """torch's module __getattr__ imports torch._dynamo or calls a deprecated attribute's replacement: a name a
    dump chooses must reach neither."""
    monkeypatch.setattr(torch, "__getattr__", lambda name: pytest.fail(f"torch.{name} looked up lazily"), raising=False)
    with pytest.raises(ValueError, match="not a torch dtype"):
        _consolidated({"leaves": {"x": (dtype, [1], 0, 4, 0)}}, torch.zeros(8, dtype=torch.uint8))


# ---- malformed files ----------------------------------------------------------------------------


SECOND = {
    "verl": "step_2.pkl",
    "slime": "4.pt",
    "miles": "2_0.pt",
    "prime-rl": "rank_1.jsonl",
    "nemo-rl": "train_data_step2.jsonl",
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("damage", ["empty", "truncated", "mixed folder"])
def test_an_empty_truncated_or_bad_file_among_good_ones_is_one_line(tmp_path, fmt, damage):
    records, top = genuine(fmt, tmp_path / "genuine")
    dump = write(fmt, tmp_path / "dump", records, top)
    (file,) = [dump] if dump.is_file() else [p for p in dump.rglob("*") if p.is_file()]
    data = file.read_bytes()
    bad = file
    if damage == "mixed folder":  # a good file first, then a bad one: exit 2 naming the bad one
        bad = file.with_name(SECOND[fmt])
        data = data[: len(data) // 2]
    bad.write_bytes(b"" if damage == "empty" else data[: len(data) // 2] if damage == "truncated" else data)
    result = probe("import", fmt, dump if dump.is_dir() else dump.parent, "--out", tmp_path / "run")
    assert_one_line_or_fine(result, "")
    assert result.exit_code == 2 or damage == "empty" and fmt in ("prime-rl", "nemo-rl"), result.output
    root = dump if dump.is_dir() else dump.parent
    assert str(bad) in result.output or str(root) in result.output
    assert (
        not (tmp_path / "run" / "manifest.json").exists()
        or '"complete"' not in (tmp_path / "run" / "manifest.json").read_text()
    )


def test_non_utf8_bytes_name_the_line(tmp_path):
    dump = write_prime_rl(tmp_path / "dump", make_seqs(n=3))
    (path,) = dump.rglob("*.jsonl")
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0] + b'{"token_ids": "\xff\xfe"}\n' + lines[2])
    result = probe("import", "prime-rl", dump, "--out", tmp_path / "run")
    assert result.exit_code == 2
    assert result.output == f"error: {path}:2: not UTF-8 text (byte 16 of the line)\n"


def test_a_slime_sample_that_is_not_a_dict_names_it(tmp_path):
    torch.save({"rollout_id": 3, "samples": [1]}, tmp_path / "3.pt")
    result = probe("import", "slime", tmp_path / "3.pt", "--out", tmp_path / "run")
    assert result.exit_code == 2
    assert "3.pt: samples[0]: is of type int, expected a dict of the sample's fields" in result.output


# ---- the fuzz test ------------------------------------------------------------------------------

JSON_BAD = [None, "x", -1, 2**31, 2**70, 1.5, float("nan"), float("inf"), True, [], {}, [[1, 2], [3]], [None], ["a"]]
PICKLE_BAD = [*JSON_BAD, b"\xff", torch.tensor([1.5, float("nan")]), np.array(["a"]), torch.zeros(2, 2, 2)]
NUMERIC_BAD = [-1, 2**40, 1e30, float("nan"), float("inf"), -float("inf"), 0.5]


# the fields each importer reads (mismatch_probe/importers/*.py): per record, and at the file's top level
TRAIN = ("tokens", "response_lengths", "loss_masks", "rollout_log_probs", "log_probs", "rollout_routed_experts")
READ = {
    "verl": (
        "prompts",
        "responses",
        "attention_mask",
        "response_mask",
        "rollout_log_probs",
        "old_log_probs",
        "routed_experts",
    ),
    "slime": TRAIN,
    "miles": TRAIN,
    "prime-rl": ("token_ids", "loss_mask", "inference_logprobs", "trainer_logprobs", "step"),
    "nemo-rl": ("token_ids", "input_lengths", "token_loss_mask", "generation_logprobs", "prev_logprobs"),
}
TOP = {"verl": ("global_steps", "temperature"), "slime": ("rollout_id",), "miles": ("rollout_id", "cp_size")}


def _mutate(fmt: str, records: list, top: dict, data, marker: Path) -> None:
    """One change, drawn by hypothesis, to one field an importer reads, in one record or at the top level."""
    record = records[data.draw(st.integers(0, len(records) - 1), label="record")]
    bad = st.sampled_from(JSON_BAD if fmt in ("prime-rl", "nemo-rl") else [*PICKLE_BAD, Payload(marker)])
    if fmt in TOP and data.draw(st.integers(0, 3), label="top level") == 0:
        entries = top["meta"] if fmt == "verl" else top
        entries[data.draw(st.sampled_from(TOP[fmt]), label="entry")] = data.draw(bad, label="value")
        return
    key = data.draw(st.sampled_from(READ[fmt]), label="field")
    action = data.draw(st.sampled_from(["delete", "replace", "element", "shorten", "lengthen", "empty"]), label="do")
    if fmt == "verl":
        return _mutate_array(record, key, action, data)
    value = record[key]
    items = value.tolist() if hasattr(value, "tolist") and np.ndim(value) else value
    if action == "delete":
        del record[key]
    elif action == "replace" or not isinstance(items, list) or not items:
        record[key] = data.draw(bad, label="value")
    elif action == "element":
        items = list(items)
        items[data.draw(st.integers(0, len(items) - 1), label="at")] = data.draw(bad, label="value")
        record[key] = items
    else:
        record[key] = {"shorten": items[:-1], "lengthen": items + items[:1], "empty": []}[action]


def _mutate_array(batch: dict, key: str, action: str, data) -> None:
    array = batch[key]
    if action == "delete":
        del batch[key]
    elif action in ("shorten", "lengthen"):
        axis = data.draw(st.integers(0, 1), label="axis")
        more = np.take(array, [0], axis=axis)
        batch[key] = (
            np.take(array, range(array.shape[axis] - 1), axis=axis)
            if action == "shorten"
            else np.concatenate([array, more], axis=axis)
        )
    elif action == "empty":  # a zero-length sample: its row all padding
        array = array.copy()
        array[data.draw(st.integers(0, len(array) - 1), label="row")] = 0
        batch[key] = array
    else:
        array = array.astype(np.float64)
        at = tuple(data.draw(st.integers(0, n - 1), label="at") for n in array.shape)
        array[at] = data.draw(st.sampled_from(NUMERIC_BAD), label="value")
        batch[key] = array if action == "element" else array.astype(np.float32)


REPORTS = {}  # format -> reports run: `probe report` on the first run that imports, to bound the time


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=12, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_dumps_end_in_exit_0_or_one_line_exit_2(tmp_path_factory, fmt, data):
    root = tmp_path_factory.mktemp("fuzz")
    marker = root / "marker"
    records, top = genuine(fmt, root / "genuine")
    _mutate(fmt, records, top, data, marker)
    dump = write(fmt, root / "dump", records, top)
    result = probe("import", fmt, dump, "--out", root / "run")
    assert_one_line_or_fine(result, str(dump))
    assert not marker.exists()
    if result.exit_code == 0 and REPORTS.setdefault(fmt, 0) < 1:
        REPORTS[fmt] += 1
        assert_one_line_or_fine(probe("report", root / "run"), str(root / "run"))


def test_log_probs_far_apart_plot_without_an_infinite_axis():
    """A dump's log-probs may be finite yet thousands apart (a -9999 sentinel): exp overflows to inf, and the
    report's log-scale k3 plot leaves that bin out instead of failing on an infinite axis limit."""
    import matplotlib.pyplot as plt

    from mismatch_probe.report.render.plots_comparison import _dots

    fig, ax = plt.subplots()
    _dots(ax, ["a", "b", "c"], np.array([1e-3, np.inf, 0.0]), "black", "k3")
    assert ax.get_ylim()[1] == pytest.approx(1.6e-3)
    plt.close(fig)


@pytest.mark.parametrize("temperature", ["inf", "nan", "0"])
def test_a_temperature_that_json_cannot_hold_is_one_line(tmp_path, temperature):
    dump = write_prime_rl(tmp_path / "dump", make_seqs(n=1))
    result = probe("import", "prime-rl", dump, "--out", tmp_path / "run", "--temperature", temperature)
    assert result.exit_code == 2 and not (tmp_path / "run").exists()
    assert result.output == f"error: --temperature {float(temperature)}: expected a finite number > 0\n"


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("dtype", [np.float16, np.int8, np.uint64, np.float32])
def test_ids_of_any_numeric_dtype_are_range_checked_without_a_warning(dtype):
    """The range check compares Python numbers: numpy would cast the limit 2**31 to float16 (overflow, a
    warning on stderr) or int8."""
    from mismatch_probe.rundir import checked

    assert checked.ids(np.array([1, 2], dtype=dtype), "W", "ids").tolist() == [1, 2]
    with pytest.raises(ProbeError, match="'ids' holds token id 100, out of range"):
        checked.ids(np.array([1, 100], dtype=dtype), "W", "ids", limit=50)


@pytest.mark.parametrize("fmt", ["prime-rl", "nemo-rl"])
def test_jsonl_with_a_bom_crlf_and_blank_lines_imports(tmp_path, fmt):
    dump = (write_prime_rl if fmt == "prime-rl" else write_nemo_rl)(tmp_path / "dump", make_seqs(n=2))
    (path,) = dump.rglob("*.jsonl")
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes().replace(b"\n", b"\r\n\r\n"))
    result = probe("import", fmt, dump, "--out", tmp_path / "run")
    assert result.exit_code == 0 and "imported 2 samples" in result.output, result.output

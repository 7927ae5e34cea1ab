"""A bad configuration stops `batchserve` at once with one line naming the key."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

from batchserve.runner.core.config import ConfigError, load
from batchserve.runner.core.timeouts import Timeouts
from tests.conftest import BATCHSERVE, ROOT

GOOD = """
runners:
  iris_clf:
    model: batchserve.runner.bundled:iris_classifier
    batching:
      enabled: true
      max_batch_size: 100
      max_latency_ms: 500
    inputs: [{name: input, datatype: FP32, shape: [-1, 4]}]
    outputs: [{name: scores, datatype: FP32, shape: [-1, 3]}]
"""

BAD = {
    "unknown key": (
        GOOD.replace("max_batch_size: 100", "max_batch_size: 100\n      max_batch: 3"),
        "runners.iris_clf.batching.max_batch is not a known key; known keys are: enabled, "
        "max_batch_elements, max_batch_size, max_latency_ms, refuse",
    ),
    "wrong type": (
        GOOD.replace("max_batch_size: 100", "max_batch_size: lots"),
        "runners.iris_clf.batching.max_batch_size has value 'lots'; it must be an integer >= 1",
    ),
    "negative latency": (
        GOOD.replace("max_latency_ms: 500", "max_latency_ms: -5"),
        "runners.iris_clf.batching.max_latency_ms has value -5; it must be a positive number",
    ),
    "unknown refusal mode": (
        GOOD.replace("max_latency_ms: 500", "max_latency_ms: 500\n      refuse: newest"),
        "runners.iris_clf.batching.refuse has value 'newest'; it must be one of at_arrival, "
        "oldest",
    ),
    "missing model": (
        GOOD.replace("    model: batchserve.runner.bundled:iris_classifier\n", ""),
        "runners.iris_clf.model is missing",
    ),
    "inconsistent timeouts": (
        "timeouts: {drain_s: 10}\n" + GOOD,
        "timeouts.kill_after_s has value 8.0; it must be at least timeouts.drain_s + 1 (11), "
        "so a process is not killed while it drains",
    ),
    "unimportable model": (
        GOOD.replace("batchserve.runner.bundled:iris_classifier", "no_such_module:model"),
        "runners.iris_clf.model has value 'no_such_module:model'; module 'no_such_module' "
        "cannot be imported (ModuleNotFoundError: No module named 'no_such_module')",
    ),
}


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BATCHSERVE, *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("command", ["validate", "serve"])
@pytest.mark.parametrize("kind", list(BAD))
def test_bad_configuration_exits_with_one_line(tmp_path: Path, kind: str, command: str) -> None:
    text, message = BAD[kind]
    path = tmp_path / "configuration.yml"
    path.write_text(text)
    args = [command, str(path)] if command == "validate" else [command, "--config", str(path)]
    result = run(*args, cwd=tmp_path)
    assert result.returncode == 3
    assert result.stderr == f"error: {message}\n"
    assert result.stdout == ""


def test_the_bundled_configuration_is_valid() -> None:
    result = run("validate", cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        "configuration.yml: valid (5 runner(s): iris_clf, mlp, text_features, text, tokenize; "
        "1 pipeline(s): classify)\n"
    )


def test_the_reference_batching_keys_are_accepted_verbatim(tmp_path: Path) -> None:
    path = tmp_path / "configuration.yml"
    path.write_text(GOOD)
    batching = load(path).runners["iris_clf"].batching
    assert (batching.enabled, batching.max_batch_size, batching.max_latency_ms) == (True, 100, 500)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("datatype: FP32, shape: [-1, 4]", "datatype: FP8, shape: [-1, 4]"),
         "runners.iris_clf.inputs[0].datatype has value 'FP8'; it must be one of BOOL, UINT8"),
        (("shape: [-1, 4]", "shape: [4, -1]"),
         "runners.iris_clf.batch_dim has value [0, 0]; inputs tensor 'input' with shape [4, -1] "
         "must have -1 (the batch) at dimension 0"),
        (("runners:", "api: {port: 70000}\nrunners:"),
         "api.port has value 70000; it must be a port number from 0 to 65535"),
        (("max_batch_size: 100", "max_batch_size: 0"),
         "runners.iris_clf.batching.max_batch_size has value 0; it must be an integer >= 1"),
        (("enabled: true", "enabled: yes please"),
         "runners.iris_clf.batching.enabled has value 'yes please'; it must be true or false"),
        (("datatype: FP32, shape: [-1, 4]", "datatype: INT32, shape: [-1, 4], finite: true"),
         "runners.iris_clf.inputs[0].finite has value True; it must be false for INT32, which "
         "cannot hold NaN"),
        (("runners:", "api: {max_inflight: 0}\nrunners:"),
         "api.max_inflight has value 0; it must be an integer >= 1"),
        (("runners:", "timeouts: {drain_s: -1}\nrunners:"),
         "timeouts.drain_s has value -1; it must be a positive number"),
        (("runners:", "timeouts: {kill_after_s: .inf}\nrunners:"),
         "timeouts.kill_after_s has value inf; it must be a positive number"),
        (("runners:", "timeouts: {ping_misses: 1.5}\nrunners:"),
         "timeouts.ping_misses has value 1.5; it must be an integer >= 1"),
        (("runners:", "timeouts: {grace_s: 3}\nrunners:"),
         "timeouts.grace_s is not a known key; known keys are: api_start_s, call_slack_s, "
         "drain_s, hello_timeout_s, keep_alive_s, kill_after_s, link_idle_s, ping_misses, "
         "ping_period_s, ping_timeout_s, "
         "reconnect_first_s, reconnect_max_s, resolve_s, restart_first_s, restart_max_s, "
         "runner_start_s, stable_s"),
        (("runners:", "timeouts: {drain_s: 5, kill_after_s: 5.5}\nrunners:"),
         "timeouts.kill_after_s has value 5.5; it must be at least timeouts.drain_s + 1 (6), "
         "so a process is not killed while it drains"),
        (("runners:", "timeouts: {restart_first_s: 60}\nrunners:"),
         "timeouts.restart_first_s has value 60.0; it must be at most timeouts.restart_max_s "
         "(30)"),
        (("runners:", "timeouts: {reconnect_max_s: 0.01}\nrunners:"),
         "timeouts.reconnect_first_s has value 0.05; it must be at most "
         "timeouts.reconnect_max_s (0.01)"),
        (("runners:", "timeouts: 30\nrunners:"),
         "timeouts has value 30; it must be a mapping"),
        (("shape: [-1, 4]}", "shape: [-1, 4], batchable: maybe}"),
         "runners.iris_clf.inputs[0].batchable has value 'maybe'; it must be true or false"),
        (("shape: [-1, 4]}", "shape: [-1, 4], batchable: false}"),
         "runners.iris_clf.inputs has only inputs with batchable: false; at least one input "
         "must be batchable, to count each request's rows"),
        (("shape: [-1, 3]}", "shape: [-1, 3], batchable: false}"),
         "runners.iris_clf.outputs[0].batchable is not a known key; known keys are: datatype, "
         "finite, name, ragged, shape"),
        (("datatype: FP32, shape: [-1, 4]", "datatype: BYTES, shape: [-1, 4], finite: true"),
         "runners.iris_clf.inputs[0].finite has value True; it must be false for BYTES, which "
         "cannot hold NaN"),
    ],
)
def test_values_are_checked_with_their_dotted_key(
    tmp_path: Path, change: tuple[str, str], message: str
) -> None:
    path = tmp_path / "configuration.yml"
    path.write_text(GOOD.replace(*change))
    with pytest.raises(ConfigError) as raised:
        load(path)
    assert str(raised.value).startswith(message)


def test_a_non_batchable_input_needs_no_batch_dimension(tmp_path: Path) -> None:
    path = tmp_path / "configuration.yml"
    path.write_text(GOOD.replace(
        "inputs: [{name: input, datatype: FP32, shape: [-1, 4]}]",
        "inputs: [{name: input, datatype: FP32, shape: [-1, 4]},\n"
        "             {name: mode, datatype: BYTES, shape: [1], batchable: false}]"))
    runner = load(path).runners["iris_clf"]
    assert [spec.batchable for spec in runner.inputs] == [True, False]
    assert runner.unbatched == frozenset({"mode"})


def test_a_missing_file_is_one_clear_line(tmp_path: Path) -> None:
    result = run("validate", str(tmp_path / "nope.yml"), cwd=tmp_path)
    assert result.returncode == 3
    assert result.stderr.startswith("error: cannot read configuration ")
    assert textwrap.dedent(result.stderr).count("\n") == 1


def test_timeouts_default_when_absent_and_are_read_when_given(tmp_path: Path) -> None:
    path = tmp_path / "configuration.yml"
    path.write_text(GOOD)
    assert load(path).timeouts == Timeouts()
    path.write_text("timeouts: {drain_s: 20, kill_after_s: 25, ping_misses: 5}\n" + GOOD)
    timeouts = load(path).timeouts
    assert (timeouts.drain_s, timeouts.kill_after_s, timeouts.ping_misses) == (20.0, 25.0, 5)
    assert timeouts.ping_period_s == Timeouts().ping_period_s


def test_the_default_timeouts_are_consistent() -> None:
    defaults = Timeouts()
    assert defaults.inconsistency() is None
    assert defaults.kill_after_s >= defaults.drain_s + 1


def test_timeouts_built_in_code_are_checked_the_same_way() -> None:
    with pytest.raises(ValueError, match=r"^timeouts\.kill_after_s has value 4\.0; it must be "
                       r"at least timeouts\.drain_s \+ 1 \(6\), so a process is not killed "
                       r"while it drains$"):
        Timeouts(kill_after_s=4.0)
    with pytest.raises(ValueError, match=r"^timeouts\.ping_misses has value 0; it must be an "
                       r"integer >= 1$"):
        Timeouts(ping_misses=0)

"""Typed, validated configuration read from `configuration.yml`.

Every error names the dotted key, the value found and what was expected, so a user can fix
the file from one line: `runners.iris_clf.batching.max_latency_ms has value -5; it must be a
positive number`. Nothing here starts a process or loads a model.
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import yaml

from .pipeline import PipelineConfig, parse_pipelines

# A runner's values live in their own module; they are read, and known to callers, as here.
from .runner_config import BATCH_INPUT_KINDS as BATCH_INPUT_KINDS
from .runner_config import CHOICES as CHOICES
from .runner_config import REFUSE_MODES as REFUSE_MODES
from .runner_config import Batching as Batching
from .runner_config import BatchInput as BatchInput
from .runner_config import BatchInputKind as BatchInputKind
from .runner_config import Choice as Choice
from .runner_config import ConfigError as ConfigError
from .runner_config import Layout as Layout
from .runner_config import Refuse as Refuse
from .runner_config import RunnerConfig as RunnerConfig
from .runner_config import TensorSpec as TensorSpec
from .timeouts import Timeouts
from .types import DATATYPES
from .wire import ADDRESS_FORMS, Address

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ApiConfig:
    host: str = "127.0.0.1"
    port: int = 3000
    grpc_port: int = 8001  # the v2 protocol over gRPC, beside HTTP; 0 turns it off
    workers: int = 2
    max_body_bytes: int = 64 * 1024 * 1024
    max_inflight: int = 1024


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """TLS for TCP links, as files (relative to the configuration's folder). A runner serves
    with its certificate and, given `api_ca`, requires API workers to show one it signed; an
    API worker checks runners against `runner_ca` and shows its own certificate if it has one."""

    runner_cert: Path | None = None
    runner_key: Path | None = None
    runner_ca: Path | None = None
    api_cert: Path | None = None
    api_key: Path | None = None
    api_ca: Path | None = None
    server_name: str | None = None  # the name runner certificates carry; default each host


@dataclass(frozen=True, slots=True)
class TransportConfig:
    """How API workers and runners trust each other (see `batchserve.runner.core.security`)."""

    token_file: Path | None = None
    insecure: bool = False  # TCP without a token: only on a network nobody else can reach
    tls: TlsConfig | None = None


@dataclass(frozen=True, slots=True)
class Config:
    runners: Mapping[str, RunnerConfig]
    api: ApiConfig = field(default_factory=ApiConfig)
    timeouts: Timeouts = field(default_factory=Timeouts)
    root: Path = Path(".")
    transport: TransportConfig = field(default_factory=TransportConfig)
    pipelines: Mapping[str, PipelineConfig] = field(default_factory=dict)
    """Chains of runners served as one model each (`batchserve.runner.core.pipeline`)."""


# --- readers: each checks one value and says what it expected ---------------------------------


def _fail(key: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"{key} has value {value!r}; it must be {expected}")


def _mapping(
    key: str, value: Any, allowed: set[str], required: tuple[str, ...] = ()
) -> Mapping[str, Any]:
    """`value` as a mapping holding only `allowed` keys, and every one of `required`."""
    if not isinstance(value, Mapping):
        raise _fail(key, value, "a mapping")
    for name in value:
        if name not in allowed:
            known = ", ".join(sorted(allowed))
            raise ConfigError(f"{key}.{name} is not a known key; known keys are: {known}")
    for name in required:
        if name not in value:
            raise ConfigError(f"{key}.{name} is missing")
    return value


def _int(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(key, value, f"an integer >= {minimum}")
    if value < minimum:
        raise _fail(key, value, f"an integer >= {minimum}")
    return value


def _positive(key: str, value: Any) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise _fail(key, value, "a positive number")
    return float(value)


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(key, value, "true or false")
    return value


def _str(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(key, value, "a non-empty string")
    return value


def _tensor(key: str, value: Any, keys: set[str]) -> TensorSpec:
    """One tensor, with only the keys in `keys` (inputs have a few more than outputs)."""
    raw = _mapping(key, value, keys, ("name", "datatype", "shape"))
    datatype = raw["datatype"]
    if datatype not in DATATYPES:
        raise _fail(f"{key}.datatype", datatype, "one of " + ", ".join(DATATYPES))
    shape = raw["shape"]
    if not isinstance(shape, list) or not shape:
        raise _fail(f"{key}.shape", shape, "a non-empty list of dimensions (-1 for variable)")
    for i, dim in enumerate(shape):
        if isinstance(dim, bool) or not isinstance(dim, int) or (dim < 1 and dim != -1):
            raise _fail(f"{key}.shape[{i}]", dim, "a positive integer or -1")
    finite = _bool(f"{key}.finite", raw.get("finite", False))
    if finite and DATATYPES[datatype].kind != "f":
        raise _fail(f"{key}.finite", finite, f"false for {datatype}, which cannot hold NaN")
    layout, pad_value = _layout(key, raw, datatype, "input" if "pad" in keys else "output")
    batchable = _bool(f"{key}.batchable", raw.get("batchable", True))
    if not batchable and layout != "rows":
        raise ConfigError(
            f"{key} has batchable: false and {layout}; an input of variable length is joined "
            "across requests, so it cannot also be given to the model per request"
        )
    return TensorSpec(
        _str(f"{key}.name", raw["name"]), datatype, tuple(shape), finite,
        layout=layout, pad_value=pad_value, batchable=batchable,
    )


def _layout(key: str, raw: Mapping[str, Any], datatype: str, what: str = "input"
            ) -> tuple[Layout, float]:
    """An input's `ragged: true` or `pad: {value: V}` (an output's `ragged: true`), and the
    value padding fills with."""
    ragged = _bool(f"{key}.ragged", raw.get("ragged", False))
    pad = raw.get("pad")
    if ragged and pad is not None:
        raise ConfigError(f"{key} has both ragged and pad; an input may have one or the other")
    if not ragged and pad is None:
        return "rows", 0.0
    layout: Layout = "ragged" if ragged else "pad"
    if DATATYPES[datatype].kind == "O":
        raise _fail(f"{key}.datatype", datatype, f"a datatype other than BYTES for a {layout} "
                    f"{what} (one sequence of numbers a request)")
    if raw["shape"] != [-1]:
        raise _fail(f"{key}.shape", raw["shape"], f"[-1] for a {layout} {what}: one flat "
                    "sequence a request, its length the dimension that varies")
    if ragged:
        return "ragged", 0.0
    value = _mapping(f"{key}.pad", pad, {"value"}).get("value", 0)
    dtype = DATATYPES[datatype]
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or np.asarray(value).astype(dtype) != value:
        raise _fail(f"{key}.pad.value", value, f"a finite number that {datatype} can hold")
    return "pad", float(value)


TENSOR_KEYS = {"name", "datatype", "shape", "finite"}
INPUT_KEYS = TENSOR_KEYS | {"batchable", "ragged", "pad"}
OUTPUT_KEYS = TENSOR_KEYS | {"ragged"}


def _tensors(key: str, value: Any, keys: set[str] = TENSOR_KEYS) -> tuple[TensorSpec, ...]:
    if not isinstance(value, list) or not value:
        raise _fail(key, value, "a non-empty list of tensors {name, datatype, shape}")
    specs = tuple(_tensor(f"{key}[{i}]", item, keys) for i, item in enumerate(value))
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise _fail(key, names, "a list of tensors with distinct names")
    return specs


def _inputs(key: str, value: Any) -> tuple[TensorSpec, ...]:
    """The inputs; at least one is batchable, since a request's rows are counted on those."""
    specs = _tensors(key, value, INPUT_KEYS)
    if all(not spec.batchable for spec in specs):
        raise ConfigError(
            f"{key} has only inputs with batchable: false; at least one input must be "
            "batchable, to count each request's rows"
        )
    return specs


def _batching(key: str, value: Any) -> Batching:
    raw = _mapping(
        key, value,
        {"enabled", "max_batch_size", "max_latency_ms", "max_batch_elements", "refuse"},
    )
    default = Batching()
    elements = raw.get("max_batch_elements")
    return Batching(
        enabled=_bool(f"{key}.enabled", raw.get("enabled", default.enabled)),
        max_batch_size=_int(
            f"{key}.max_batch_size", raw.get("max_batch_size", default.max_batch_size), 1
        ),
        max_latency_ms=_positive(
            f"{key}.max_latency_ms", raw.get("max_latency_ms", default.max_latency_ms)
        ),
        max_batch_elements=(
            None if elements is None else _int(f"{key}.max_batch_elements", elements, 1)
        ),
        refuse=_one_of(f"{key}.refuse", raw.get("refuse", default.refuse), REFUSE_MODES),
    )


def _batch_dim(key: str, value: Any, runner: RunnerConfig) -> tuple[int, int]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value, value]
    if not isinstance(value, list) or len(value) != 2:
        raise _fail(key, value, "an [input, output] pair of dimension indices")
    dims = (_int(f"{key}[0]", value[0], 0), _int(f"{key}[1]", value[1], 0))
    for (spec_key, specs), dim in zip(
        (("inputs", runner.inputs), ("outputs", runner.outputs)), dims, strict=True
    ):
        for spec in specs:
            if not spec.batchable:  # it has no batch dimension: each request brings its own
                continue
            if dim >= len(spec.shape) or spec.shape[dim] != -1:
                raise ConfigError(
                    f"{key} has value {list(value)!r}; {spec_key} tensor {spec.name!r} with "
                    f"shape {list(spec.shape)} must have -1 (the batch) at dimension {dim}"
                )
    return dims


RUNNER_KEYS = {
    "model", "workers", "batching", "inputs", "outputs", "batch_dim", "threads",
    "batch_timeout_ms", "batch_inputs", "addresses", "group_by", "choice",
}


def _variable_length(key: str, runner: RunnerConfig) -> None:
    """Ragged and pad inputs: one layout for every input, and a cap stated in elements."""
    varying = next((spec for spec in runner.inputs if spec.layout != "rows"), None)
    for i, spec in enumerate(runner.inputs):
        if varying is not None and not spec.batchable:
            raise ConfigError(
                f"{key}.inputs[{i}] ({spec.name!r}) has batchable: false; since input "
                f"{varying.name!r} is {varying.layout}, every input is joined across requests "
                "and none may be batchable: false"
            )
        if varying is not None and spec.layout != varying.layout:
            raise ConfigError(
                f"{key}.inputs[{i}] ({spec.name!r}) is {_layout_text(spec.layout)}; since "
                f"input {varying.name!r} is {varying.layout}, every input must be "
                f"{varying.layout}"
            )
    elements = runner.batching.max_batch_elements
    if varying is not None and elements is None:
        raise ConfigError(
            f"{key}.batching.max_batch_elements is missing; a runner with {varying.layout} "
            "inputs needs it: the most elements one batch may hold"
        )
    if varying is None and elements is not None:
        raise ConfigError(
            f"{key}.batching.max_batch_elements has value {elements!r}; it applies only to a "
            "runner whose inputs are ragged or pad (this one batches rows: use max_batch_size)"
        )


def _layout_text(layout: Layout) -> str:
    return "neither ragged nor pad" if layout == "rows" else layout


def _batch_input(key: str, value: Any, runner: RunnerConfig) -> BatchInput:
    raw = _mapping(key, value, {"kind", "name", "source", "datatype"}, ("kind", "name", "source"))
    kind = raw["kind"]
    if kind not in BATCH_INPUT_KINDS:
        raise _fail(f"{key}.kind", kind, "one of " + ", ".join(BATCH_INPUT_KINDS))
    source = _str(f"{key}.source", raw["source"])
    inputs = [spec.name for spec in runner.inputs]
    if source not in inputs:
        raise _fail(f"{key}.source", source, "the name of an input: " + ", ".join(inputs))
    datatype = raw.get("datatype", "INT64")
    if datatype not in DATATYPES or DATATYPES[datatype].kind not in "iuf":
        numeric = [name for name, dtype in DATATYPES.items() if dtype.kind in "iuf"]
        raise _fail(f"{key}.datatype", datatype, "one of " + ", ".join(numeric))
    return BatchInput(kind, _str(f"{key}.name", raw["name"]), source, datatype)


def _batch_inputs(key: str, value: Any, runner: RunnerConfig) -> tuple[BatchInput, ...]:
    """The generated inputs: named apart from the inputs, and one at least for each input
    of variable length, without which the model could not tell its requests apart."""
    if runner.layout == "rows":
        if value is None:
            return ()
        raise ConfigError(
            f"{key} is set, but no input is ragged or pad; batch inputs describe how "
            "variable-length requests were joined"
        )
    if not isinstance(value, list) or not value:
        raise _fail(key, value, "a non-empty list of {kind, name, source} for "
                    f"{runner.layout} inputs")
    made = tuple(_batch_input(f"{key}[{i}]", item, runner) for i, item in enumerate(value))
    names = [spec.name for spec in runner.inputs] + [made_one.name for made_one in made]
    if len(set(names)) != len(names):
        raise _fail(key, [item.name for item in made],
                    "names distinct from each other and from the inputs")
    sources = {item.source for item in made}
    for spec in runner.inputs:
        if spec.name not in sources:
            raise ConfigError(
                f"{key} has no entry with source {spec.name!r}; the model of a "
                f"{runner.layout} input needs its element counts (e.g. kind "
                "accumulated_element_count) to find each request"
            )
    return made


def _addresses(key: str, value: Any) -> tuple[Address, ...]:
    if not isinstance(value, list) or not value:
        raise _fail(key, value, "a non-empty list of addresses such as tcp:10.0.0.5:7000 "
                    "or dns+tcp:runners.example:7000")
    addresses = []
    for i, text in enumerate(value):
        try:
            addresses.append(Address.parse(_str(f"{key}[{i}]", text)))
        except ValueError:
            raise _fail(f"{key}[{i}]", text, f"an address {ADDRESS_FORMS}") from None
    if len(set(addresses)) != len(addresses):
        raise _fail(key, value, "a list of distinct addresses")
    return tuple(addresses)


def _one_of(key: str, value: Any, allowed: tuple[T, ...]) -> T:
    for option in allowed:
        if value == option:
            return option
    raise _fail(key, value, "one of " + ", ".join(map(str, allowed)))


def _runner(key: str, name: str, value: Any) -> RunnerConfig:
    raw = _mapping(key, value, RUNNER_KEYS, ("model", "inputs", "outputs"))
    model = _str(f"{key}.model", raw["model"])
    if ":" not in model:
        raise _fail(f"{key}.model", model, "an import path 'module:attribute'")
    runner = RunnerConfig(
        name=name,
        model=model,
        inputs=_inputs(f"{key}.inputs", raw["inputs"]),
        outputs=_tensors(f"{key}.outputs", raw["outputs"], OUTPUT_KEYS),
        workers=_int(f"{key}.workers", raw.get("workers", 1), 1),
        batching=_batching(f"{key}.batching", raw.get("batching", {})),
        threads=_int(f"{key}.threads", raw.get("threads", 1), 1),
        batch_timeout_ms=(None if raw.get("batch_timeout_ms") is None
                          else _positive(f"{key}.batch_timeout_ms", raw["batch_timeout_ms"])),
        addresses=(_addresses(f"{key}.addresses", raw["addresses"]) if "addresses" in raw
                   else ()),
        choice=_one_of(f"{key}.choice", raw.get("choice", "random"), CHOICES),
    )
    batch_dim = _batch_dim(f"{key}.batch_dim", raw.get("batch_dim", [0, 0]), runner)
    _variable_length(key, runner)
    batch_inputs = _batch_inputs(f"{key}.batch_inputs", raw.get("batch_inputs"), runner)
    taken = {spec.name for spec in runner.inputs} | {made.name for made in batch_inputs}
    group_by, group_timing = _group_by(f"{key}.group_by", raw.get("group_by", []), taken)
    return RunnerConfig(**{
        **_fields(runner), "batch_dim": batch_dim, "batch_inputs": batch_inputs,
        "group_by": group_by, "group_timing": group_timing,
    })


def _group_by(
    key: str, value: Any, inputs: set[str]
) -> tuple[tuple[str, ...], tuple[tuple[str, Any], ...]]:
    """Parameter names, each once, none an input's (the model gets both as keywords); as a
    mapping, each with the value the model is timed with at start-up."""
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, list):
        pairs = [(item, None) for item in value]
    else:
        raise _fail(key, value, "a list of request parameter names, or a mapping from each "
                    "to the value the model is timed with at start-up")
    names: list[str] = []
    for i, (item, timing) in enumerate(pairs):
        where = f"{key}[{i}]" if isinstance(value, list) else f"{key}.{item}"
        name = _str(where, item)
        if not name.isidentifier():
            raise _fail(where, name, "a Python identifier (the model takes it as a keyword)")
        if name in names or name in inputs:
            what = "named twice" if name in names else "also an input's name"
            raise ConfigError(f"{where} has value {name!r}, {what}; each must be distinct")
        if name in RESERVED_PARAMETERS:
            raise ConfigError(f"{where} has value {name!r}, a parameter the server reads itself")
        if isinstance(value, dict) and not isinstance(timing, str | int | float):
            raise _fail(where, timing, "a string, a number or a boolean to time the model with")
        names.append(name)
    if len(names) > 255:
        raise ConfigError(f"{key} names {len(names)} parameters; at most 255")
    timing_pairs = tuple(pairs) if isinstance(value, dict) else ()
    return tuple(names), timing_pairs


RESERVED_PARAMETERS = frozenset({"timeout", "binary_data_output"})
"""Request parameters with a meaning of their own in the v2 protocol."""


def _fields(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__slots__}


def _api(key: str, value: Any) -> ApiConfig:
    raw = _mapping(key, value, {"host", "port", "grpc_port", "workers", "max_body_bytes",
                                "max_inflight"})
    default = ApiConfig()
    ports = {}
    for name in ("port", "grpc_port"):
        port = ports[name] = _int(f"{key}.{name}", raw.get(name, getattr(default, name)), 0)
        if port > 65535:
            raise _fail(f"{key}.{name}", port, "a port number from 0 to 65535")
    return ApiConfig(
        host=_str(f"{key}.host", raw.get("host", default.host)),
        port=ports["port"],
        grpc_port=ports["grpc_port"],
        workers=_int(f"{key}.workers", raw.get("workers", default.workers), 1),
        max_body_bytes=_int(
            f"{key}.max_body_bytes", raw.get("max_body_bytes", default.max_body_bytes), 1
        ),
        max_inflight=_int(
            f"{key}.max_inflight", raw.get("max_inflight", default.max_inflight), 1
        ),
    )


def _timeouts(key: str, value: Any) -> Timeouts:
    """Each value checked alone, then together (`Timeouts` refuses an inconsistent set)."""
    raw = _mapping(key, value, {item.name for item in fields(Timeouts)})
    values: dict[str, Any] = {
        name: _int(f"{key}.{name}", given, 1) if name == "ping_misses"
        else _positive(f"{key}.{name}", given)
        for name, given in raw.items()
    }
    try:
        return Timeouts(**values)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


TLS_PAIRS = (("runner_cert", "runner_key"), ("api_cert", "api_key"))


def _path(key: str, value: Any, root: Path) -> Path:
    return root / _str(key, value)


def _tls(key: str, value: Any, root: Path) -> TlsConfig:
    raw = _mapping(key, value, {item.name for item in fields(TlsConfig)})
    for cert, secret in TLS_PAIRS:
        if (cert in raw) != (secret in raw):
            have, lack = (cert, secret) if cert in raw else (secret, cert)
            raise ConfigError(f"{key}.{have} is set but {key}.{lack} is missing; give both")
    paths = {name: _path(f"{key}.{name}", given, root)
             for name, given in raw.items() if name != "server_name"}
    name = raw.get("server_name")
    return TlsConfig(**paths, server_name=None if name is None
                     else _str(f"{key}.server_name", name))


def _transport(key: str, value: Any, root: Path) -> TransportConfig:
    raw = _mapping(key, value, {"token_file", "insecure", "tls"})
    token_file = raw.get("token_file")
    return TransportConfig(
        token_file=None if token_file is None else _path(f"{key}.token_file", token_file, root),
        insecure=_bool(f"{key}.insecure", raw.get("insecure", False)),
        tls=None if raw.get("tls") is None else _tls(f"{key}.tls", raw["tls"], root),
    )


def parse(document: Any, root: Path = Path(".")) -> Config:
    """Build a `Config` from a loaded YAML document, or raise `ConfigError`."""
    raw = _mapping("configuration", document,
                   {"runners", "api", "timeouts", "transport", "pipelines"})
    runners = raw.get("runners")
    if not isinstance(runners, Mapping) or not runners:
        raise _fail("runners", runners, "a mapping of at least one runner name to its settings")
    parsed = {}
    for name, value in runners.items():
        if not isinstance(name, str) or not name.replace("_", "").replace("-", "").isalnum():
            raise _fail("runners", name, "keyed by names of letters, digits, '_' and '-'")
        parsed[name] = _runner(f"runners.{name}", name, value)
    return Config(
        runners=parsed,
        api=_api("api", raw.get("api", {})),
        timeouts=_timeouts("timeouts", raw.get("timeouts", {})),
        root=root,
        transport=_transport("transport", raw.get("transport", {}), root),
        pipelines=parse_pipelines(raw.get("pipelines"), parsed),
    )


def load(path: str | Path) -> Config:
    """Read and validate a configuration file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read configuration {str(path)!r}: {exc.strerror}") from None
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    return parse(document, root=path.resolve().parent)


def resolve(config: Config, runner: RunnerConfig) -> Callable[..., Any] | Any:
    """Import the object a runner's `model` names; the config file's folder is importable."""
    module_name, _, attribute = runner.model.partition(":")
    key = f"runners.{runner.name}.model"
    root = str(config.root)
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an import runs user code: any failure is a config error
        raise ConfigError(
            f"{key} has value {runner.model!r}; module {module_name!r} cannot be imported "
            f"({type(exc).__name__}: {exc})"
        ) from None
    target: Any = module
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError(
                f"{key} has value {runner.model!r}; module {module_name!r} has no "
                f"attribute {attribute!r}"
            ) from None
    return target

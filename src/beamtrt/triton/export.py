"""Write a build as a Triton model repository (preprocessing -> beam_dflash2 -> postprocessing, and the ensemble), then
validate it: every config.pbtxt parses as tritonclient's ModelConfig, no placeholder is left, every referenced path
exists, the ensemble's steps fit together, and the world size is the build's TP.

The configs are rendered from the tables below and the tensor tables of `beamtrt.triton.protocol`; the model.py files
are copied from `beamtrt/triton/models/`. The repository is written into a temporary directory beside --out and
renamed into place at the end, so a failure never leaves a half-written repository.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from beamtrt.checkpoint.hf import holds, replace_dir, resolved, staging
from beamtrt.checkpoint.manifest import MANIFEST, read_manifest
from beamtrt.cli_util import output_path
from beamtrt.config import drafter_block_error
from beamtrt.errors import BeamtrtError, ConfigError
from beamtrt.prompts import has_tokenizer
from beamtrt.runtime.loader import build_context, check_device, missing_engines
from beamtrt.triton import protocol, serving
from beamtrt.triton.protocol import Tensor
from beamtrt.triton.serving import ServeSettings, SettingError

MODEL = "beam_dflash2"
MAX_BATCH_SIZE = 1  # each request is one sequence [1, ...]; requests are batched inside beam_dflash2 (max_slots)
MODELS_SOURCE = Path(__file__).resolve().parent / "models"
PYTHON_PATH = Path(serving.__file__).resolve().parents[2]  # the folder holding the beamtrt package
COPIED_ENGINE = f"{MODEL}/1/engine"  # where --copy-engines puts the build, relative to the repository
LAUNCH = "scripts/launch_triton.sh"
ONE_MESSAGE = {"role": "user", "content": "x"}  # a text_input request's chat, the shortest
# --max-slots and --max-seq-len left unset: these, or what the build serves where it serves less
MAX_SLOTS, MAX_SEQ_LEN = ServeSettings.max_slots, ServeSettings.max_seq_len
RAW_TEXT_INPUT = "the prompt, as raw text (no chat template)"  # text_input's help in a --raw-prompts repository


class ExportError(BeamtrtError):
    """The build cannot be served as it is, or the written repository does not validate."""


# ---- the models (tables) -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Model:
    name: str
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    decoupled: bool = False


MODELS = (
    Model("preprocessing", tuple(replace(t, optional=False) for t in protocol.PRE_INPUTS), protocol.PRE_OUTPUTS),
    Model(MODEL, protocol.FIELDS, protocol.OUTPUTS, decoupled=True),
    Model("postprocessing", protocol.POST_INPUTS, protocol.POST_OUTPUTS),
)
_OWN = ("max_tokens", "min_length", "temperature", "top_p", "top_k", "random_seed", "end_id", "pad_id", "stop_words",
        "bad_words", "stream", "beam_width", "num_return_sequences", "exclude_input_in_output", "finish_reason",
        "acceptance_length", "accepted_draft_tokens", "draft_tokens")
# (model, {its input: ensemble tensor}, {its output: ensemble tensor}); "_" marks tensors internal to the ensemble,
# the others are the ensemble's own inputs (consumed, never produced) and outputs
STEPS = (
    ("preprocessing", {"text_input": "text_input"}, {"input_ids": "_input_ids"}),
    (MODEL, {"input_ids": "_input_ids", **{t.name: t.name for t in protocol.FIELDS if t.name in _OWN}},
     {"output_ids": "_output_ids", "context_ids": "_context_ids", "text_end": "_text_end",
      **{t.name: t.name for t in protocol.OUTPUTS if t.name in _OWN}}),
    ("postprocessing", {"output_ids": "_output_ids", "context_ids": "_context_ids", "text_end": "_text_end"},
     {"text_output": "text_output"}),
)


def ensemble_tensors() -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """The ensemble's inputs and outputs, taken from the step models' own tensors."""
    spec = {m.name: m for m in MODELS}
    produced = {name for _, _, outs in STEPS for name in outs.values()}
    inputs, outputs = {}, {}
    for model, ins, outs in STEPS:
        by_name = {t.name: t for t in spec[model].inputs}
        inputs.update({e: replace(by_name[k], name=e) for k, e in ins.items() if e not in produced})
        by_name = {t.name: t for t in spec[model].outputs}
        outputs.update({e: replace(by_name[k], name=e) for k, e in outs.items() if not e.startswith("_")})
    return tuple(inputs.values()), tuple(outputs.values())


# ---- protobuf text format --------------------------------------------------------------------------------------

class Enum(str):
    """A bare enum value in protobuf text format (TYPE_INT32, KIND_CPU)."""


def render(message: dict, indent: int = 0) -> str:
    """dict -> protobuf text format. Values: str, int, bool, Enum, dict (a message), list of dicts (repeated
    messages) or of scalars (a repeated scalar)."""
    pad, lines = "  " * indent, []
    for key, value in message.items():
        if isinstance(value, dict):
            lines += [f"{pad}{key} {{", render(value, indent + 1), f"{pad}}}"]
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            items = [f"{pad}  {{\n{render(v, indent + 2)}\n{pad}  }}" for v in value]
            lines += [f"{pad}{key} [", ",\n".join(items), f"{pad}]"]
        elif isinstance(value, list):
            lines.append(f"{pad}{key}: [ {', '.join(_scalar(v) for v in value)} ]")
        else:
            lines.append(f"{pad}{key}: {_scalar(value)}")
    return "\n".join(lines)


def _scalar(value: object) -> str:
    if isinstance(value, Enum):
        return str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return str(value)


def _tensors(tensors: tuple[Tensor, ...]) -> list[dict]:
    return [{"name": t.name, "data_type": Enum(t.dtype), "dims": list(t.dims), **({"optional": True} if t.optional
                                                                                  else {})} for t in tensors]


def python_config(model: Model, parameters: dict[str, str]) -> dict:
    config = {"name": model.name, "backend": "python", "max_batch_size": MAX_BATCH_SIZE}
    if model.decoupled:
        config["model_transaction_policy"] = {"decoupled": True}
    return {**config, "input": _tensors(model.inputs), "output": _tensors(model.outputs),
            "instance_group": [{"count": 1, "kind": Enum("KIND_CPU")}],
            "parameters": [{"key": k, "value": {"string_value": v}} for k, v in parameters.items()]}


def ensemble_config() -> dict:
    inputs, outputs = ensemble_tensors()
    steps = [{"model_name": model, "model_version": -1,
              "input_map": [{"key": k, "value": v} for k, v in ins.items()],
              "output_map": [{"key": k, "value": v} for k, v in outs.items()]} for model, ins, outs in STEPS]
    return {"name": "ensemble", "platform": "ensemble", "max_batch_size": MAX_BATCH_SIZE,
            "input": _tensors(inputs), "output": _tensors(outputs), "ensemble_scheduling": {"step": steps}}


# ---- the build -------------------------------------------------------------------------------------------------

def has_chat_template(tokenizer: Path) -> bool:
    """Whether a tokenizer folder carries a chat template (its own file, or in tokenizer_config.json)."""
    if (tokenizer / "chat_template.jinja").is_file() or (tokenizer / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((tokenizer / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def check_build(root: Path, chat_template: bool = True) -> dict:
    """The manifest of a build output fit to serve (with a chat template where text_input goes through one);
    one-line ExportError / CheckpointError otherwise."""
    manifest = read_manifest(root)  # names a missing directory or one that is not a build
    try:
        tp, target, drafter = manifest["mapping"]["tp_size"], manifest["target"]["dir"], manifest["drafter"]["dir"]
        tokenizer = manifest["target"]["tokenizer"]
    except (KeyError, TypeError) as e:
        raise ExportError(f"{root / MANIFEST} lacks {e}: rebuild with build/build_engines.py") from None
    if not tokenizer or not has_tokenizer(root / tokenizer):  # its chat template or generation config alone: none
        raise ExportError(f"{root}: the build has no tokenizer/ (preprocessing needs the target's tokenizer and chat "
                          "template): rebuild from a checkpoint with tokenizer files")
    if chat_template and not has_chat_template(root / tokenizer):
        raise ExportError(f"{root / tokenizer}: the tokenizer has no chat template, which text_input goes through: "
                          "pass --raw-prompts (text_input sent as raw text), or rebuild from a checkpoint with one")
    for name in (target, drafter):
        if not (root / name).is_dir():
            raise ExportError(f"{root / name}: missing (the manifest lists it)")
        ranks = sorted(p.name for p in (root / name).glob("rank*.safetensors"))
        if ranks != sorted(f"rank{r}.safetensors" for r in range(tp)):
            raise ExportError(f"{root / name} holds {len(ranks)} rank file(s) but the manifest says tp {tp}")
    engines = manifest.get("engines") or {}
    for part in ("target", "drafter") if engines.get("built") else ():
        if not engines.get(part):
            raise ExportError(f"{root / MANIFEST}: the engines are marked built but 'engines.{part}' names no "
                              "directory: rebuild with build/build_engines.py --force")
        missing = [r for r in range(tp) if not (root / engines[part] / f"rank{r}.engine").is_file()]
        if missing:
            raise ExportError(f"{root / engines[part]}: rank{missing[0]}.engine missing (the manifest says built)")
    from beamtrt.checkpoint.validate import validate

    validate(root)  # every file's sha256 and every tensor against the manifest
    return manifest


# ---- the repository --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ExportConfig:
    engine_dir: Path
    out: Path
    copy_engines: bool = False
    force: bool = False
    backend: str = "auto"
    block_size: int | None = None   # None: the build's
    dtype: str | None = None        # None: bfloat16 (the torch backend's compute; not with backend trt)
    device: str | None = None       # None: auto (likewise)
    max_slots: int | None = None    # None: MAX_SLOTS, or the engines' --max-batch-size where lower
    max_seq_len: int | None = None  # None: MAX_SEQ_LEN, or the most the build serves where lower
    seed: int = 0
    chat_template: bool = True
    draft_threshold: float = 0.0


def export(cfg: ExportConfig) -> list[str]:
    """Write and validate the repository at cfg.out; returns summary lines."""
    _model_config()  # the repository is validated at the end: a missing tritonclient is said before the work
    root, out = resolved(cfg.engine_dir), resolved(cfg.out)
    if holds(root, out):
        raise ExportError(f"--out {out} is {'the' if out == root else 'inside the'} engine directory; choose another "
                          "place")
    if holds(out, root):
        raise ExportError(f"--out {out} holds the engine directory {root}: an export replaces its --out, so choose "
                          "another place")
    package = PYTHON_PATH / "beamtrt"
    if holds(out, package) or holds(package, out):
        raise ExportError(f"--out {out}: is or holds the beamtrt package the repository's models import "
                          f"({package}); choose another place")
    output_path(cfg.out, "--out", directory=True)  # a file is refused, --force or not; the parent must be writable
    if existed := out.exists() and any(out.iterdir()):  # --force replaces an export, never a folder of anything else
        stray = stray_paths(out)
        if stray or not (out / MODEL / "config.pbtxt").is_file():  # a repository a user added models to, say
            why = f"it holds {stray[0]}, which an export does not write" if stray else f"no {MODEL}/config.pbtxt"
            raise ExportError(f"{out} already exists and is not a model repository export_triton.py wrote ({why}): "
                              "choose another --out, or empty it first")
    manifest = check_build(root, cfg.chat_template)
    engine = Path(COPIED_ENGINE) if cfg.copy_engines else root
    block = manifest["drafter"]["block_size"] if cfg.block_size is None else cfg.block_size
    built = (manifest.get("engines") or {}).get("settings") or {}  # the engines' build settings
    no_engines = missing_engines(manifest)
    if cfg.backend == "trt" and no_engines:
        raise ExportError(f"--backend trt: the build has no engines ({no_engines})")
    given = [flag for flag, value in (("--dtype", cfg.dtype), ("--device", cfg.device)) if value is not None]
    if cfg.backend == "trt" and given:
        raise ExportError(f"{given[0]} sets the torch backend's compute; --backend trt serves the engines as built")
    dtype = "bfloat16" if cfg.dtype is None else cfg.dtype
    device = "auto" if cfg.device is None else cfg.device
    # what the server would refuse at its start or first step: engines (trt, and auto where the build has them: it
    # serves them on a TensorRT-LLM host) run their own block and batch; a request's tokens stop at the build's context
    on_engines = cfg.backend != "torch" and not no_engines
    auto = (" (auto serves the engines on a TensorRT-LLM host; --backend torch serves the checkpoints)"
            if cfg.backend == "auto" else "")
    if on_engines and built.get("block_size") not in (None, block):
        raise ExportError(f"--backend {cfg.backend}: the engines verify blocks of {built['block_size']}, not "
                          f"--block-size {block}{auto}")
    batch = built.get("max_batch_size") if on_engines else None
    max_slots = min(MAX_SLOTS, batch or MAX_SLOTS) if cfg.max_slots is None else cfg.max_slots
    if batch and max_slots > batch:
        raise ExportError(f"--backend {cfg.backend}: --max-slots {max_slots} is above the engines' --max-batch-size "
                          f"{batch}{auto}")
    context = build_context(root, manifest, "torch")  # the target's context, or the build's --max-seq-len where lower
    by_build = context == built.get("max_seq_len")
    what = "the build's --max-seq-len" if by_build else "the target's context"
    max_seq_len = min(MAX_SEQ_LEN, context) if cfg.max_seq_len is None else cfg.max_seq_len
    if max_seq_len > context:
        raise ExportError(f"--max-seq-len {max_seq_len} is above {what} of {context} tokens")
    try:
        settings = ServeSettings(engine, manifest["mapping"]["tp_size"], cfg.backend, block, dtype, device,
                                 max_slots, max_seq_len, cfg.seed, cfg.chat_template, cfg.draft_threshold)
    except SettingError as e:  # named as the flag it came from (each setting is export_triton.py's flag of its name)
        if e.name == "max_seq_len" and cfg.max_seq_len is None:  # not given: the build's own length is too short
            if on_engines:  # their block is fixed
                remedy = "rebuild with a larger --max-seq-len, or pass --backend torch and a smaller --block-size"
            else:
                remedy = "pass a smaller --block-size" + (" or rebuild with a larger --max-seq-len" if by_build else "")
            raise ExportError(f"{what} of {context} tokens leaves no room for a request in blocks of {block} "
                              f"(--max-seq-len {e.why}): {remedy}") from None
        raise ExportError(f"--{e.name.replace('_', '-')} {e.why}") from None
    if cfg.chat_template:  # a text_input request is the template's tokens around its text: a context below them
        from beamtrt.prompts import load_tokenizer, render_chat  # refuses every one (beam_dflash2's input_ids fit)
        from beamtrt.spec.decoder import headroom

        try:
            template = len(render_chat(load_tokenizer(root / manifest["target"]["tokenizer"]), [ONE_MESSAGE]))
        except ValueError as e:  # a template that wants a system prompt first, say: text_input requests would fail
            template = None
            print(f"warning: {root / manifest['target']['tokenizer']}: {e} for a chat of one user message, which "
                  "is how the server renders a text_input request, so it will refuse them; beam_dflash2's input_ids "
                  "are served, and --raw-prompts serves text without the template", file=sys.stderr)
        if template is not None and max_seq_len < (least := template + 1 + headroom(block)):
            print(f"warning: --max-seq-len {max_seq_len} leaves no room for a text_input request, which the server "
                  f"will refuse: the chat template around a one-token message is {template} tokens, so at least "
                  f"{least} (one new token at --block-size {block}); beam_dflash2's input_ids fit, and "
                  "--raw-prompts serves text without the template", file=sys.stderr)
    if device != "auto" and (cfg.backend == "torch" or (cfg.backend == "auto" and no_engines)):
        check_device(device, "torch", manifest["mapping"]["tp_size"],  # the server would refuse it
                     other="serve the build's engines (--backend trt)")
    trained = manifest["drafter"].get("train_block_size")
    if trained is not None and (why := drafter_block_error(block, trained)):  # the server's decoder would refuse it
        raise ExportError(why)
    if existed and not cfg.force:  # said after every input's check, which --force does not skip
        raise ExportError(f"{out} already holds a model repository: pass --force to replace it")
    with staging(out, None if cfg.force else "pass --force to replace it") as tmp:
        if cfg.copy_engines:
            shutil.copytree(root, tmp / COPIED_ENGINE)
        tokenizer = str(engine / manifest["target"]["tokenizer"])
        text = {"python_path": str(PYTHON_PATH), "tokenizer_dir": tokenizer}
        serve = settings.to_parameters()
        parameters = {"preprocessing": {**text, "chat_template": serve["chat_template"]},
                      MODEL: {**serve, "python_path": str(PYTHON_PATH)},
                      "postprocessing": text}
        for model in MODELS:
            _write_model(tmp, model.name, render(python_config(model, parameters[model.name])))
        _write_model(tmp, "ensemble", render(ensemble_config()))
        (tmp / "README.md").write_text(readme(out, root, manifest, settings))
        summary = [line.replace(str(tmp), str(out)) for line in check_repository(tmp)]
        replace_dir(tmp, out)
    return [f"{out}: Triton model repository of {root}", *summary,
            f"launch: {LAUNCH} --world-size {settings.world_size} --model-repo {shlex.quote(str(out))}"]


def stray_paths(repo: Path) -> list[str]:
    """What `repo` holds that an export does not write (relative paths, sorted): --force replaces an export whole, so
    it must hold nothing else, at any depth. A copied build (--copy-engines) and the bytecode Python writes beside a
    model.py it imported (a server that ran the repository) count as the export's, whole."""
    whole = {COPIED_ENGINE}
    ours = {"README.md"}
    for name in (*(m.name for m in MODELS), "ensemble"):
        ours |= {name, f"{name}/config.pbtxt", f"{name}/1"}
        if (MODELS_SOURCE / name / "1" / "model.py").is_file():
            ours.add(f"{name}/1/model.py")
            whole.add(f"{name}/1/__pycache__")
    stray, known = [], ours | whole
    for folder, dirs, files in os.walk(repo):
        here = Path(folder).relative_to(repo)
        stray += [path for name in dirs + files if (path := (here / name).as_posix()) not in known]
        dirs[:] = [d for d in dirs if (here / d).as_posix() in ours]  # not into a stray folder, nor a whole one
    return sorted(stray)


def _write_model(repo: Path, name: str, config: str) -> None:
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    (repo / name / "config.pbtxt").write_text(config + "\n")
    source = MODELS_SOURCE / name / "1" / "model.py"
    if source.is_file():
        shutil.copyfile(source, repo / name / "1" / "model.py")  # the mode a new file gets, as every file here


def readme(out: Path, root: Path, manifest: dict, s: ServeSettings) -> str:
    text = "through the target's chat template" if s.chat_template else "as raw text (exported with --raw-prompts)"
    where = f"a copy of `{root}` in `{COPIED_ENGINE}/`" if not s.engine_dir.is_absolute() else f"`{root}` (referenced)"
    return f"""# Triton model repository: Beam + DFlash2 ({manifest['precision']}, TP {s.world_size})

Exported by `scripts/export_triton.py` from {where}.
Launch it from the beamtrt checkout: one Triton process per rank (leader mode: rank 0 serves requests, the other
ranks step with it):

```bash
{LAUNCH} --world-size {s.world_size} --model-repo {shlex.quote(str(out))}
```

Then query it over gRPC streaming (the client sends text to `{MODEL}` by default; `--model ensemble` goes through the
ensemble):

```bash
.venv/bin/python scripts/triton_client.py --prompt "Write a haiku about GPUs." --max-tokens 64
```

| model | what it does |
|---|---|
| `preprocessing` | `text_input` -> `input_ids` {text} |
| `{MODEL}` | decoupled Python model: speculative decoding (backend {s.backend}, block {s.block_size}{compute(s)}, \
up to {s.max_slots} request{'s' * (s.max_slots != 1)} at once, {s.max_seq_len} tokens each) |
| `postprocessing` | `output_ids` -> `text_output` |
| `ensemble` | the three in a chain |

The ensemble's tensors (each with a leading batch dimension of 1):

| tensor | type | |
|---|---|---|
{tensor_rows(s.chat_template)}

See docs/TRITON.md in the beamtrt checkout.
"""


def tensor_rows(chat_template: bool = True) -> str:
    inputs, outputs = ensemble_tensors()
    helps = {} if chat_template else {"text_input": RAW_TEXT_INPUT}
    return "\n".join(f"| {kind} `{t.name}` | {t.dtype.removeprefix('TYPE_')} {list(t.dims)}"
                     f"{', optional' if t.optional else ''} | {helps.get(t.name, t.help)} |"
                     for kind, tensors in (("in", inputs), ("out", outputs)) for t in tensors)


# ---- validation ------------------------------------------------------------------------------------------------

def _model_config():
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError:
        raise ExportError("validating the repository needs tritonclient: pip install 'tritonclient[grpc]'") from None
    return text_format, model_config_pb2


def parse_config(path: Path):
    """config.pbtxt -> tritonclient's ModelConfig message; ExportError (one line) when it does not parse."""
    text_format, pb2 = _model_config()
    text = path.read_text()
    if "${" in text:
        line = next(n for n, s in enumerate(text.splitlines(), 1) if "${" in s)
        raise ExportError(f"{path}:{line}: an unfilled ${{...}} placeholder")
    try:
        return text_format.Parse(text, pb2.ModelConfig())
    except text_format.ParseError as e:
        raise ExportError(f"{path}: does not parse as a Triton ModelConfig: {e}") from None


def check_repository(repo: Path) -> list[str]:
    """Validate a written model repository; returns summary lines, raises ExportError on the first problem."""
    configs = {}
    for name in [m.name for m in MODELS] + ["ensemble"]:
        if not (repo / name / "config.pbtxt").is_file():
            raise ExportError(f"{repo / name / 'config.pbtxt'}: missing")
        cfg = configs[name] = parse_config(repo / name / "config.pbtxt")
        if cfg.name != name:
            raise ExportError(f"{repo / name / 'config.pbtxt'}: name {cfg.name!r} is not the folder's {name!r}")
        if cfg.backend == "python" and not (repo / name / "1" / "model.py").is_file():
            raise ExportError(f"{repo / name / '1' / 'model.py'}: missing")
    if not configs[MODEL].model_transaction_policy.decoupled:
        raise ExportError(f"{MODEL}/config.pbtxt: not decoupled (streaming needs model_transaction_policy decoupled)")
    _check_ensemble(configs)
    params = {name: {k: v.string_value for k, v in cfg.parameters.items()} for name, cfg in configs.items()}
    for name, values in params.items():
        for key in ("python_path", "tokenizer_dir", "engine_dir"):
            if key in values and not (repo / values[key]).exists():
                raise ExportError(f"{name}/config.pbtxt: {key} {repo / values[key]} does not exist")
    try:
        settings = ServeSettings.from_parameters(params[MODEL], repo)  # checks every parameter's type and range
    except ConfigError as e:
        raise ExportError(str(e)) from None
    manifest = read_manifest(settings.engine_dir)
    tp = manifest["mapping"]["tp_size"]
    if settings.world_size != tp:
        raise ExportError(f"{MODEL}/config.pbtxt: world_size {settings.world_size} but {settings.engine_dir} was "
                          f"built for tp {tp}")
    for part in (manifest["target"]["dir"], manifest["drafter"]["dir"]):
        missing = [r for r in range(tp) if not (settings.engine_dir / part / f"rank{r}.safetensors").is_file()]
        if missing:
            raise ExportError(f"{settings.engine_dir / part}: rank{missing[0]}.safetensors missing for tp {tp}")
    return [f"{len(configs)} models ({', '.join(configs)}): every config.pbtxt parses as a Triton ModelConfig, no "
            "placeholder left, every path exists, the ensemble's steps fit together",
            f"engines: {settings.engine_dir} ({manifest['precision']}, tp {tp} = world size {settings.world_size}), "
            f"backend {settings.backend}, block {settings.block_size}{compute(settings)}"]


def compute(s: ServeSettings) -> str:
    """The torch backend's compute settings, for summaries (the engines of backend trt run as built)."""
    return "" if s.backend == "trt" else f", {s.dtype}, device {s.device}"


def _check_ensemble(configs: dict) -> None:
    """Every step's model exists and maps only tensors it has, every required input is fed, and each ensemble tensor
    has one data type wherever it is used."""
    ensemble = configs["ensemble"]
    types = {t.name: t.data_type for t in ensemble.input}
    fed = set(types)
    for step in ensemble.ensemble_scheduling.step:
        where = f"ensemble step {step.model_name!r}"
        if step.model_name not in configs:
            raise ExportError(f"{where}: no such model in the repository")
        cfg = configs[step.model_name]
        ins, outs = {t.name: t for t in cfg.input}, {t.name: t for t in cfg.output}
        for key, tensor in step.input_map.items():
            if key not in ins:
                raise ExportError(f"{where}: maps input {key!r}, which the model does not have")
            if tensor not in fed:
                raise ExportError(f"{where}: input {key!r} reads {tensor!r}, which no earlier step produces")
            if types[tensor] != ins[key].data_type:
                raise ExportError(f"{where}: input {key!r} has another data type than {tensor!r}")
        unfed = [t.name for t in cfg.input if not t.optional and t.name not in step.input_map]
        if unfed:
            raise ExportError(f"{where}: required input {unfed[0]!r} is not mapped")
        for key, tensor in step.output_map.items():
            if key not in outs:
                raise ExportError(f"{where}: maps output {key!r}, which the model does not have")
            types[tensor] = outs[key].data_type
            fed.add(tensor)
    for t in ensemble.output:
        if t.name not in fed or types[t.name] != t.data_type:
            raise ExportError(f"ensemble output {t.name!r} is not produced by a step with its data type")

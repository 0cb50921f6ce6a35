"""Rank files written by Megatron-LM / MindSpeed-LLM (no mindrl metadata) convert exactly.

The foreign checkpoints are built from mindrl-converted tiny HF models: their args are
rewritten in Megatron-LM's names (derived here from the HF config, independently of
mindrl's table), their tensors renamed and re-padded as Megatron-LM lays them out, and a
separate process pickles them together with objects of classes that exist only in that
process (Megatron enums, a rerun-state object, numpy RNG state, optimizer and scheduler
state, and an object whose unpickling would run a shell command). Converting them back
must give the original HF files bit for bit, or HF transformers' own logits.
"""

import argparse
import dataclasses
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from mindrl.checkpoint import megatron as mg
from mindrl.ckpt_convert import hf_to_mcore, mcore_to_hf, mcore_to_mcore
from mindrl.config import ConfigError, ModelArch, ParallelConfig, load_model_arch
from mindrl.config.paths import MODEL_CONFIGS_DIR
from mindrl.models import arch_fields, hf_mapping
from tests.hf_models import build_hf_model, save_hf_model

ROOT = Path(__file__).resolve().parents[1]

# Runs in its own process: the classes below exist only there, so the loader cannot import them.
WRITER = r'''
import argparse, enum, io, json, os, random, sys, types
import numpy as np
import torch

def register(module, **objects):
    parts = module.split(".")
    for i in range(1, len(parts) + 1):  # parents too, so pickle never imports the real packages
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    mod = sys.modules[module]
    for name, obj in objects.items():
        obj.__module__, obj.__qualname__ = module, name
        setattr(mod, name, obj)

ModelType = enum.Enum("ModelType", "encoder_or_decoder retro_encoder retro_decoder")
AttnBackend = enum.Enum("AttnBackend", "flash fused unfused local auto")

class RerunStateMachineState:
    def __init__(self):
        self.mode, self.counters = "disabled", {"steps": 7}

class Trap:
    def __reduce__(self):
        return (os.system, ("touch " + os.environ["TRAP_MARKER"],))

register("megatron.core.enums", ModelType=ModelType)
register("megatron.core.transformer.enums", AttnBackend=AttnBackend)
register("mindspeed_llm.core.rerun", RerunStateMachineState=RerunStateMachineState)

for job in json.loads(open(sys.argv[1]).read()):
    payload = torch.load(job["payload"], weights_only=True)
    models = payload["models"]
    for key in payload["extra_state"]:
        chunk, name = key.split("/", 1)
        models[chunk][name] = io.BytesIO(b"te-fp8-metadata")
    params = [t for m in models.values() for t in m.values() if torch.is_tensor(t)]
    state = {"checkpoint_version": 3.0, "iteration": payload["iteration"], **models,
             "optimizer": {"optimizer": {"state": {i: {"exp_avg": torch.zeros_like(t, dtype=torch.float32),
                                                       "step": torch.tensor(5.0)} for i, t in enumerate(params)},
                                         "param_groups": [{"lr": 1e-6, "betas": (0.9, 0.95),
                                                           "params": list(range(len(params)))}]},
                           "fp32_from_fp16_params": [[t.float() for t in params]]},
             "opt_param_scheduler": {"max_lr": 1e-6, "num_steps": 5, "decay_style": "cosine"},
             "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
                            "rng_tracker_states": {"model-parallel-rng": torch.get_rng_state()}}],
             "rerun_state_machine": RerunStateMachineState(), "trap": Trap(),
             "num_floating_point_operations_so_far": 1.5e12}
    if payload["args"] is not None:
        state["args"] = argparse.Namespace(**payload["args"], model_type=ModelType.encoder_or_decoder,
                                           attention_backend=AttnBackend.auto)
    os.makedirs(os.path.dirname(job["path"]), exist_ok=True)
    torch.save(state, job["path"])
'''

# Transformer Engine's fused names for the local spec's norms.
TE_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


def megatron_lm_args(config: dict, tp: int, pp: int, padded: int, style: str, **extra) -> dict:
    """Megatron-LM's args for an HF config, as its training scripts set them."""
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    args = dict(
        num_layers=config["num_hidden_layers"], hidden_size=hidden, ffn_hidden_size=config["intermediate_size"],
        num_attention_heads=heads, group_query_attention=config["num_key_value_heads"] != heads,
        num_query_groups=config["num_key_value_heads"], kv_channels=config.get("head_dim") or hidden // heads,
        max_position_embeddings=config["max_position_embeddings"], position_embedding_type="rope",
        rotary_base=int(config.get("rope_theta") or config["rope_parameters"]["rope_theta"]),
        rotary_percent=1.0, rotary_interleaved=False, padded_vocab_size=padded, vocab_size=None,
        untie_embeddings_and_output_weights=not config["tie_word_embeddings"], add_bias_linear=False,
        add_qkv_bias=config["model_type"] == "qwen2", qk_layernorm=config["model_type"] == "qwen3",
        normalization="RMSNorm", swiglu=True, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None, params_dtype=torch.float32, bf16=False, fp16=False,
        num_experts=None, multi_latent_attention=False, ckpt_format="torch", lr=1e-6, seq_length=64,
        micro_batch_size=1, global_batch_size=8, seed=1234, attention_softmax_in_fp32=False)
    if style == "megatron-lm":  # current Megatron-LM: TE layers, the TransformerConfig name of the epsilon
        args.update(layernorm_epsilon=config["rms_norm_eps"], transformer_impl="transformer_engine",
                    use_legacy_models=False)
    else:  # MindSpeed-LLM (Megatron core_r0.x): local layers, norm_epsilon, its own extra args
        args.update(norm_epsilon=config["rms_norm_eps"], transformer_impl="local", use_mcore_models=True,
                    num_layer_list=None, noop_layers=None, use_fused_rmsnorm=True, post_norm=False)
    args.update(extra)
    return args


def _repad(slices: list[torch.Tensor], vocab: int, rows: int) -> list[torch.Tensor]:
    """Vocabulary rows of every TP rank, padded to `rows` in all instead of mindrl's padding."""
    full = torch.cat(slices)[:vocab]
    full = torch.cat([full, full.new_zeros(rows - vocab, *full.shape[1:])])
    return [t.clone() for t in full.chunk(len(slices))]


def foreign_payloads(src: Path, out: Path, config: dict, style: str, padded: int, virtual: int = 1,
                     with_args: bool = True, **extra) -> list[dict]:
    """Rank-file payloads of a Megatron-LM / MindSpeed-LLM checkpoint with the weights of mindrl
    checkpoint `src` (for a virtual pipeline, `src` must be PP=1 and is regrouped into chunks)."""
    stored = torch.load(next(src.rglob("model_optim_rng.pt")), weights_only=True)["args"]
    tp, pp = stored.tensor_model_parallel_size, stored.pipeline_model_parallel_size
    models = {}
    for path in src.rglob("model_optim_rng.pt"):
        parts = path.parent.name.split("_")
        models[(int(parts[2]), int(parts[3]) if len(parts) > 3 else 0)] = torch.load(path, weights_only=True)["model"]
    for p in range(pp):  # Megatron pads the vocabulary to a multiple of 128 × TP, not of TP
        for name in VOCAB:
            if name in models[(0, p)]:
                for t, piece in enumerate(_repad([models[(t, p)][name] for t in range(tp)],
                                                 config["vocab_size"], padded)):
                    models[(t, p)][name] = piece
    chunks = {}
    if virtual == 1:
        chunks = {key: {"model": model} for key, model in models.items()}
    else:  # chunk (p, v) holds layers v·L/vpp + p·L/(pp·vpp) onward (Megatron's layer offset)
        pp, layers = 2, config["num_hidden_layers"]
        per_chunk = layers // (pp * virtual)
        for t in range(tp):
            for p in range(pp):
                chunks[(t, p)] = {}
                for v in range(virtual):
                    first = v * layers // virtual + p * per_chunk
                    chunk = {}
                    for name, tensor in models[(t, 0)].items():
                        if name.startswith("decoder.layers."):
                            index = int(name.split(".")[2])
                            if first <= index < first + per_chunk:
                                chunk[f"decoder.layers.{index - first}.{name.split('.', 3)[3]}"] = tensor
                        elif name.startswith("embedding.") and p == 0 and v == 0:
                            chunk[name] = tensor
                        elif not name.startswith("embedding.") and p == pp - 1 and v == virtual - 1:
                            chunk[name] = tensor
                    chunks[(t, p)][f"model{v}"] = chunk
    args = megatron_lm_args(config, tp, pp, padded, style, **extra) if with_args else None
    if virtual > 1:
        args.update(virtual_pipeline_model_parallel_size=virtual, num_layers_per_virtual_pipeline_stage=per_chunk)
    jobs = []
    for (t, p), rank_chunks in chunks.items():
        extra_state = []
        if style == "megatron-lm":
            for key, chunk in rank_chunks.items():
                for name in list(chunk):
                    prefix, _, suffix = name.partition(".layers.")
                    index, _, rest = suffix.partition(".")
                    if rest in TE_NAMES:
                        chunk[f"{prefix}.layers.{index}.{TE_NAMES[rest]}"] = chunk.pop(name)
                        extra_state.append(f"{key}/{prefix}.layers.{index}.self_attention.core_attention._extra_state")
                        extra_state.append(f"{key}/{prefix}.layers.{index}.mlp.linear_fc1._extra_state")
        payload = out.parent / f".{out.name}-payload-{t}-{p}.pt"
        torch.save({"models": rank_chunks, "args": args, "iteration": 1200, "extra_state": extra_state}, payload)
        rank_dir = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
        jobs.append({"payload": str(payload), "path": str(out / "iter_0001200" / rank_dir / "model_optim_rng.pt")})
    out.mkdir(parents=True)
    (out / "latest_checkpointed_iteration.txt").write_text("1200")
    return jobs


def read_hf(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def assert_same_hf_weights(back: Path, original: Path) -> None:
    expected, actual = read_hf(original), read_hf(back)
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    """HF originals, and foreign checkpoints holding their weights, written by another process."""
    root = tmp_path_factory.mktemp("foreign")
    hf, cfg, jobs = {}, {}, []
    for kind in ("qwen2", "llama3", "qwen3"):
        hf[kind] = save_hf_model(build_hf_model(kind, seed=3), root / f"hf_{kind}")
        cfg[kind] = json.loads((hf[kind] / "config.json").read_text())
    sources = {"qwen2_tp2pp2": hf_to_mcore(hf["qwen2"], root / "m1", "qwen2", 2, 2, params_dtype=torch.float32,
                                           progress=False),
               "llama3_pp2": hf_to_mcore(hf["llama3"], root / "m2", "llama3", 1, 2, "3,1",
                                         params_dtype=torch.float32, progress=False),
               "qwen3_tp2": hf_to_mcore(hf["qwen3"], root / "m3", "qwen3", 2, 1, params_dtype=torch.float32,
                                        progress=False)}
    out = {name: root / name for name in ("lm_qwen2", "mindspeed_llama3", "mindspeed_llama3_noop", "lm_llama3_first",
                                          "lm_qwen3_vpp", "noargs_qwen3")}
    jobs += foreign_payloads(sources["qwen2_tp2pp2"], out["lm_qwen2"], cfg["qwen2"], "megatron-lm", 256)
    jobs += foreign_payloads(sources["llama3_pp2"], out["mindspeed_llama3"], cfg["llama3"], "mindspeed", 256,
                             num_layer_list="3,1", make_vocab_size_divisible_by=1)
    # the same layers as 6 with two no-op layers ending stage 1 (MindSpeed-LLM writes nothing for those)
    jobs += foreign_payloads(sources["llama3_pp2"], out["mindspeed_llama3_noop"], cfg["llama3"], "mindspeed", 256,
                             num_layers=6, noop_layers="4,5", make_vocab_size_divisible_by=1)
    jobs += foreign_payloads(sources["llama3_pp2"], out["lm_llama3_first"], cfg["llama3"], "megatron-lm", 256,
                             decoder_first_pipeline_num_layers=3)
    jobs += foreign_payloads(sources["qwen3_tp2"], out["lm_qwen3_vpp"], cfg["qwen3"], "megatron-lm", 256, virtual=2)
    jobs += foreign_payloads(sources["qwen3_tp2"], out["noargs_qwen3"], cfg["qwen3"], "mindspeed", 256,
                             with_args=False)
    (root / "jobs.json").write_text(json.dumps(jobs))
    (root / "writer.py").write_text(WRITER)
    marker = root / "trap-ran"
    subprocess.run([sys.executable, str(root / "writer.py"), str(root / "jobs.json")], check=True,
                   env={**os.environ, "TRAP_MARKER": str(marker)}, cwd=root)
    return hf, out, marker


def test_megatron_lm_checkpoint_converts_to_the_original_hf_weights(tmp_path, foreign):
    """TP=2×PP=2, TE names and _extra_state, vocabulary padded to 128×TP, tied embedding copy."""
    hf, out, marker = foreign
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        torch.load(next(out["lm_qwen2"].rglob("*.pt")), weights_only=True)
    assert not hasattr(mg.load_args(out["lm_qwen2"]), "mindrl_arch")
    mcore_to_hf(out["lm_qwen2"], tmp_path / "back", hf_config_dir=hf["qwen2"], progress=False)
    assert_same_hf_weights(tmp_path / "back", hf["qwen2"])
    assert not marker.exists()  # the pickled os.system call was never made


def test_mindspeed_llm_checkpoint_without_hf_config_gives_hf_logits(tmp_path, foreign):
    """No HF config at hand: the architecture and config.json come from the args alone, and
    transformers loads the result and computes the original model's logits."""
    hf, out, _ = foreign
    mcore_to_hf(out["mindspeed_llama3"], tmp_path / "back", progress=False)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 256
    assert_same_hf_weights(tmp_path / "back", hf["llama3"])
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = transformers.AutoModelForCausalLM.from_pretrained(hf["llama3"]).eval()(tokens).logits
        actual = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()(tokens).logits
    assert torch.equal(actual, expected)


def test_mindspeed_llm_checkpoint_with_noop_layers_converts_without_them(tmp_path, foreign):
    """num_layers counts MindSpeed-LLM's no-op layers, which hold no weights: the model has the others."""
    hf, out, _ = foreign
    mcore_to_hf(out["mindspeed_llama3_noop"], tmp_path / "back", progress=False)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_hidden_layers"] == 4
    assert_same_hf_weights(tmp_path / "back", hf["llama3"])


def test_uneven_pipeline_and_virtual_pipeline_checkpoints(tmp_path, foreign):
    hf, out, _ = foreign
    mcore_to_hf(out["lm_llama3_first"], tmp_path / "first", hf_config_dir=hf["llama3"], progress=False)
    assert_same_hf_weights(tmp_path / "first", hf["llama3"])
    mcore_to_hf(out["lm_qwen3_vpp"], tmp_path / "vpp", hf_config_dir=hf["qwen3"], progress=False)
    assert_same_hf_weights(tmp_path / "vpp", hf["qwen3"])


def test_checkpoint_without_args_needs_an_hf_config(tmp_path, foreign):
    hf, out, _ = foreign
    with pytest.raises(ConfigError, match=r"stores no args .* pass --hf-config-dir with the model's HF "
                                          r"config.json and --model-type-hf\.$"):
        mcore_to_hf(out["noargs_qwen3"], tmp_path / "back", progress=False)
    mcore_to_hf(out["noargs_qwen3"], tmp_path / "back", hf_config_dir=hf["qwen3"], progress=False)
    assert_same_hf_weights(tmp_path / "back", hf["qwen3"])


def test_reshard_a_foreign_checkpoint_then_convert(tmp_path, foreign):
    """mg -> mg reads the Megatron-LM files, writes mindrl's; the weights survive exactly."""
    hf, out, _ = foreign
    mcore_to_mcore(out["lm_qwen2"], tmp_path / "tp1", 1, 2, "1,3", hf_config_dir=hf["qwen2"], progress=False)
    assert (tmp_path / "tp1" / "latest_checkpointed_iteration.txt").read_text().strip() == "1200"
    assert mg.load_rank(tmp_path / "tp1", 0, 1)["iteration"] == 1200
    mcore_to_hf(tmp_path / "tp1", tmp_path / "back", progress=False)
    assert_same_hf_weights(tmp_path / "back", hf["qwen2"])


def test_cli_converts_without_importing_megatron_or_running_pickled_code(tmp_path, foreign):
    hf, out, marker = foreign
    code = ("import sys; from mindrl.ckpt_convert.cli import main; "
            "rc = main(sys.argv[1:]); print(rc, 'megatron' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, "--load-model-type", "mg", "--save-model-type", "hf",
                           "--load-dir", str(out["lm_qwen3_vpp"]), "--save-dir", str(tmp_path / "back"),
                           "--hf-cfg-dir", str(hf["qwen3"]), "--use-mcore-models", "--model-type", "GPT"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.stdout.split() == ["0", "False"], done.stderr
    assert_same_hf_weights(tmp_path / "back", hf["qwen3"])
    assert not marker.exists()


def _write_rank(root: Path, state: dict, rank_dir: str = "mp_rank_00") -> Path:
    path = root / "iter_0000010" / rank_dir / "model_optim_rng.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    (root / "latest_checkpointed_iteration.txt").write_text("10")
    return root


@pytest.mark.parametrize("change, message", [
    (dict(multi_latent_attention=True), r"multi-latent attention needs kv_lora_rank as a positive integer, got "
                                        r"None"),
    (dict(num_experts=8, moe_layer_freq=2), r"trained with moe_layer_freq=2 \(experts every few layers\), which "
                                            r"mindrl does not convert"),
    (dict(noop_layers="0"), r"noop_layers puts layer 0 inside pipeline stage 0 \(layers 0 to 3\); .* move it to "
                            r"the end of its stage"),
    (dict(num_layers=None), r"args lack num_layers, so they do not describe the architecture; pass "
                            r"--hf-config-dir"),
    (dict(schedules_method="dualpipev"), r"trained with schedules_method='dualpipev' \(a DualPipeV schedule, whose "
                                         r"rank files hold V-ordered model chunks"),
    (dict(num_nextn_predict_layers=1), r"trained with num_nextn_predict_layers=1 \(multi-token-prediction layers"),
    (dict(position_embedding_type="learned_absolute"), r"position_embedding_type must be rope \(or mrope for a "
                                                        r"vision-language model\), got .learned_absolute."),
])
def test_unsupported_or_incomplete_args_are_one_sentence(tmp_path, change, message):
    config = json.loads(build_hf_model("llama3").config.to_json_string())
    args = megatron_lm_args(config, 1, 1, 256, "mindspeed", **change)
    root = _write_rank(tmp_path / "mg", {"args": argparse.Namespace(**args), "checkpoint_version": 3.0,
                                         "model": {"embedding.word_embeddings.weight": torch.zeros(256, 64)}})
    with pytest.raises(ConfigError, match=message):
        mcore_to_hf(root, tmp_path / "back", progress=False)
    assert not (tmp_path / "back").exists()


def test_files_mindrl_cannot_read_are_named(tmp_path):
    damaged = _write_rank(tmp_path / "damaged", {})
    (damaged / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(OSError, match=r"model_optim_rng.pt cannot be read as a torch checkpoint .*; it is damaged"):
        mcore_to_hf(damaged, tmp_path / "back", progress=False)
    config = json.loads(build_hf_model("llama3").config.to_json_string())
    for flag in (False, True):  # told by the args (MindSpeed-LLM without --use-mcore-models), or by the keys
        args = argparse.Namespace(**megatron_lm_args(config, 1, 1, 256, "mindspeed", use_mcore_models=flag))
        legacy = _write_rank(tmp_path / f"legacy{flag}", {"checkpoint_version": 3.0, "args": args,
                                                         "model": {"language_model": {"embedding": {}}}})
        with pytest.raises(ConfigError, match=r"is a legacy \(non-mcore\) Megatron model"):
            mcore_to_hf(legacy, tmp_path / "back", progress=False)
    dist = tmp_path / "dist"
    (dist / "iter_0000010").mkdir(parents=True)
    (dist / "iter_0000010" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (dist / "latest_checkpointed_iteration.txt").write_text("10")
    with pytest.raises(ConfigError, match=r"distributed format \(torch_dist\).*cli/convert_ckpt.py, which reads it"):
        mcore_to_hf(dist, tmp_path / "back", progress=False)
    assert not (tmp_path / "back").exists()


def test_one_table_maps_every_architecture_field_both_ways():
    """Every ModelArch field has a row (attention_bias is stored nowhere); every shipped model
    survives ModelArch -> Megatron-LM args (without mindrl_arch) -> ModelArch and -> HF config -> ModelArch."""
    fields = {f.name for f in dataclasses.fields(ModelArch)} - {"name", "attention_bias"}
    assert set(arch_fields.LINKS) == fields
    for name in sorted(p.stem for p in MODEL_CONFIGS_DIR.glob("*.yaml")):
        arch = load_model_arch(name)
        args = vars(mg.checkpoint_args(arch, ParallelConfig(2, 1), torch.bfloat16))
        foreign = argparse.Namespace(**{k: v for k, v in args.items() if k != "mindrl_arch"})
        back = mg.arch_of(foreign, name)
        assert arch_fields.arch_differences(back, arch, 2) == [], name
        assert back.padded_vocab_size == arch.padded_vocab_size, name
        family = hf_mapping.model_type_hf_of(arch)
        config = hf_mapping.hf_config_from_arch(arch, family, torch.bfloat16)
        assert arch_fields.arch_differences(hf_mapping.arch_from_hf_config(config, family), arch, 1) == [], name

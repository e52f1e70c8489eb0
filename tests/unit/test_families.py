"""The families users arrive with (models/families.py), against transformers on tiny random models built here
(never downloaded): conversion both ways with logits within 1e-5 (fp32) for llama (plain, llama3
and yarn RoPE), mistral, qwen2 and qwen3; the RoPE rules and qk-norm against transformers' own
functions; the presets' parameter counts against the published ones; GPT2BPETokenizer ids against
transformers' GPT-2 tokenizer on vocab/merges files trained here."""
from __future__ import annotations

import json
import os

import pytest
import torch

import transformers
import safetensors  # noqa: F401 (test extra)

from megatron_sp.models import GPTConfig, GPTModel, preset   # noqa: E402
from megatron_sp.models import families                     # noqa: E402
from megatron_sp.models.rope import rope_frequencies        # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_sp.testing import load_script  # noqa: E402
convert = load_script("tools/checkpoint/convert.py")

VOCAB = 301
LOGITS_ATOL = 1e-5
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              rms_norm_eps=1e-6)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
YARN = {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0,
        "original_max_position_embeddings": 16, "beta_fast": 8.0, "beta_slow": 1.0}

# (name, transformers config class, model class, config kwargs, expected model_type on export)
CASES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                   tie_word_embeddings=False), "llama"),
    "llama3.1 rope scaling": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                              dict(rope_parameters=LLAMA3, tie_word_embeddings=True), "llama"),
    "llama yarn": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                   dict(rope_parameters=YARN, tie_word_embeddings=False), "llama"),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(sliding_window=None, rope_parameters={"rope_type": "default",
                                                           "rope_theta": 1e6},
                     tie_word_embeddings=False), "llama"),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(tie_word_embeddings=False, use_sliding_window=False), "qwen2"),
    "qwen3 (head_dim 32 != 64/4, tied, yarn)": (
        transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
        dict(head_dim=32, tie_word_embeddings=True, rope_parameters=dict(YARN, rope_theta=1e6)),
        "qwen3"),
}


def _hf_model(config_cls, model_cls, kwargs, seed=0):
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**COMMON, **kwargs}))
    with torch.no_grad():   # non-trivial norms and biases, so that a mix-up would show
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model.eval()


def _logits(model, tokens):
    with torch.no_grad():
        out = model(tokens)
    return (out.logits if hasattr(out, "logits") else out).float()


@pytest.mark.parametrize("name", list(CASES))
def test_family_roundtrip(name, tmp_path):
    import megatron_sp
    config_cls, model_cls, kwargs, family = CASES[name]
    hf = _hf_model(config_cls, model_cls, kwargs)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    expected = _logits(hf, tokens)

    convert.main(["--loader", "hf", "--saver", "megatron_sp", "--load-dir", str(tmp_path / "hf"),
                  "--save-dir", str(tmp_path / "ours")])
    ours = megatron_sp.load_pretrained(str(tmp_path / "ours"))
    diff = (_logits(ours, tokens) - expected).abs().max().item()
    assert diff <= LOGITS_ATOL, f"{name}: HF -> ours logits differ by {diff}"
    direct = megatron_sp.load_pretrained(str(tmp_path / "hf"))     # a HF folder, converted in memory
    assert torch.equal(_logits(direct, tokens), _logits(ours, tokens))

    convert.main(["--loader", "megatron_sp", "--saver", "hf", "--load-dir", str(tmp_path / "ours"),
                  "--save-dir", str(tmp_path / "hf2")])
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf2")).eval()
    written = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert written["model_type"] == family
    assert written["tie_word_embeddings"] == bool(hf.config.tie_word_embeddings)
    want_rope = (hf.config.rope_parameters or {}).get("rope_type", "default")
    assert written["rope_parameters"]["rope_type"] == want_rope
    diff = (_logits(back, tokens) - expected).abs().max().item()
    assert diff <= LOGITS_ATOL, f"{name}: ours -> HF logits differ by {diff}"


def test_mistral_exports_as_mistral_and_sliding_window_is_refused_when_it_matters(tmp_path):
    cfg_cls, model_cls = transformers.MistralConfig, transformers.MistralForCausalLM
    hf = _hf_model(cfg_cls, model_cls, dict(sliding_window=16, tie_word_embeddings=False))
    config, full = families.hf_to_megatron_sp(hf.config.to_dict(), hf.state_dict())
    assert config.sliding_window == 16
    model = families.model_from_full(config, full).eval()
    short = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(2))
    assert (_logits(model, short) - _logits(hf, short)).abs().max().item() <= LOGITS_ATOL
    with pytest.raises(ValueError, match="exceeds the model's sliding window 16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    hf_config, state = families.megatron_sp_to_hf(config, families.full_tensors(model))
    assert hf_config["model_type"] == "mistral" and hf_config["sliding_window"] == 16
    back = transformers.MistralForCausalLM(transformers.AutoConfig.for_model(**hf_config)).eval()
    back.load_state_dict(state)
    assert (_logits(back, short) - _logits(hf, short)).abs().max().item() <= LOGITS_ATOL
    with pytest.raises(families.ConversionError, match="export it as mistral"):
        families.megatron_sp_to_hf(config, full, family="llama")
    # pretrain_gpt.py refuses a --seq-length beyond the converted checkpoint's window.
    import sys
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    convert.main(["--loader", "hf", "--saver", "megatron_sp", "--load-dir", str(tmp_path / "hf"),
                  "--save-dir", str(tmp_path / "ours")])
    sys.path.insert(0, ROOT)
    import pretrain_gpt
    flags = ("--mock-data --vocab-size 300 --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
             "--num-query-groups 2 --ffn-hidden-size 96 --swiglu --position-embedding-type rope "
             "--normalization RMSNorm --disable-bias-linear --untie-embeddings-and-output-weights "
             "--max-position-embeddings 64 --seq-length 32 --train-iters 1 --eval-iters 0 "
             "--attention-backend sdpa --finetune").split()
    from megatron_sp.errors import ConfigError
    with pytest.raises(ConfigError, match="exceeds the sliding window 16 of the checkpoint"):
        pretrain_gpt.main(flags + ["--load", str(tmp_path / "ours")])


def test_export_writes_tokenizer_ids(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<|begin_of_text|>": 1, "<|end_of_text|>": 2, "a": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                            eos_token="<|end_of_text|>").save_pretrained(tmp_path / "tok")
    hf = _hf_model(transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=16))
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    convert.main(["--loader", "hf", "--saver", "megatron_sp", "--load-dir", str(tmp_path / "hf"),
                  "--save-dir", str(tmp_path / "ours")])
    convert.main(["--loader", "megatron_sp", "--saver", "hf", "--load-dir", str(tmp_path / "ours"),
                  "--save-dir", str(tmp_path / "hf2"), "--tokenizer-model", str(tmp_path / "tok")])
    written = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"]) == (1, 2)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf2").eos_token_id == 2


def test_unsupported_families_refused_in_one_sentence():
    # mixtral, qwen3_moe and qwen2_moe convert (tests/unit/test_moe_conversion.py); the others not
    with pytest.raises(families.ConversionError, match="mixture-of-experts model megatron_sp does "
                                                       "not convert"):
        families.hf_to_megatron_sp({"model_type": "deepseek_v3", "n_routed_experts": 8}, {})
    with pytest.raises(families.ConversionError, match="config.json has no hidden_size"):
        families.hf_to_megatron_sp({"model_type": "qwen2_moe", "num_experts": 8}, {})
    with pytest.raises(families.ConversionError, match="attention sinks"):
        families.hf_to_megatron_sp({"model_type": "gpt_oss"}, {})
    linear = dict(COMMON, model_type="llama", rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                               "rope_theta": 1e4})
    with pytest.raises(families.ConversionError, match="rope_type='linear' is not supported"):
        families.hf_to_megatron_sp(linear, {})
    with pytest.raises(SystemExit, match="^error: .*mixture-of-experts"):
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump({"model_type": "deepseek_v3", "n_routed_experts": 8}, f)
            open(os.path.join(d, "model.safetensors"), "wb").close()
            convert.main(["--loader", "hf", "--saver", "megatron_sp", "--load-dir", d,
                          "--save-dir", os.path.join(d, "out")])
    qwen2_like = preset("llama-tiny", add_qkv_bias=True, add_bias_linear=False)
    with pytest.raises(families.ConversionError, match="qwen3 needs no biases and qk-norm"):
        families.megatron_sp_to_hf(qwen2_like, {}, family="qwen3")


# RoPE rules and qk-norm against transformers' own functions -------------------------------------

def _ours(**kw):
    base = dict(num_layers=1, hidden_size=256, num_attention_heads=2, vocab_size=10, kv_channels=128,
                position_embedding_type="rope", max_position_embeddings=131072)
    return GPTConfig(**{**base, **kw})


@pytest.mark.parametrize("rope", [
    dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
         high_freq_factor=4.0, original_max_position_embeddings=8192),
    dict(rope_type="llama3", rope_theta=10000.0, factor=32.0, low_freq_factor=2.0,
         high_freq_factor=8.0, original_max_position_embeddings=1024),
    dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=32768),
    dict(rope_type="yarn", rope_theta=1e4, factor=16.0, original_max_position_embeddings=4096,
         beta_fast=16.0, beta_slow=2.0, mscale=0.8, mscale_all_dim=0.6, truncate=False),
])
def test_rope_rules_equal_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hf_config = transformers.Qwen3Config(hidden_size=256, num_attention_heads=2, head_dim=128,
                                         max_position_embeddings=131072, rope_parameters=rope)
    inv_ref, scale_ref = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, "cpu")
    fields = families._rope_fields(dict(hf_config.to_dict(), rope_parameters=rope))
    inv, scale = rope_frequencies(_ours(**fields))
    rel = ((inv - inv_ref.float()).abs() / inv_ref.abs()).max().item()
    assert rel <= 1e-6, rel                                 # float32 rounding only
    assert abs(scale - scale_ref) <= 1e-12
    assert not torch.allclose(inv, rope_frequencies(_ours(rotary_base=rope["rope_theta"]))[0])


def test_qk_layernorm_equals_transformers_qwen3_attention_norm():
    """Our per-head q/k RMSNorm (before RoPE) is Qwen3's q_norm / k_norm on every head."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    torch.manual_seed(3)
    model = GPTModel(_ours(hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=32,
                           qk_layernorm=True, normalization="RMSNorm", norm_epsilon=1e-6,
                           max_position_embeddings=64))
    attn = model.layers["0"].attention
    ref = Qwen3RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        attn.q_layernorm.weight.normal_()
        ref.weight.copy_(attn.q_layernorm.weight)
    x = torch.randn(2, 5, 4, 32)                           # [b, s, heads, d]
    assert torch.allclose(attn.q_layernorm(x), ref(x), atol=1e-6)
    assert attn.q_layernorm.weight.sequence_parallel       # gradient summed over tp (grad_sync)


def test_qk_layernorm_keeps_only_the_qkv_output_for_backward():
    """qk-norm + RoPE are recomputed in backward: the layer keeps exactly one more tensor, the QKV
    output, (h + 2g) * d values per token (the planner's term for --qk-layernorm)."""
    from megatron_sp.memory import measure_saved_bytes
    from megatron_sp.memory.accounting import layer_bytes
    from megatron_sp.models.init import init_parameters
    b, s, saved = 2, 32, {}
    for qk in (False, True):
        cfg = preset("qwen3-0.6b", num_layers=1, hidden_size=64, num_attention_heads=4,
                     num_query_groups=2, kv_channels=32, ffn_hidden_size=128, vocab_size=300,
                     max_position_embeddings=64, qk_layernorm=qk)
        model = GPTModel(cfg)
        init_parameters(model, seed=1)
        ids = torch.randint(0, 300, (b, s), generator=torch.Generator().manual_seed(0))
        loss, report = measure_saved_bytes(model, ids, ids)
        saved[qk] = (loss.item(), layer_bytes(report)["layer 0"])
    assert saved[True][0] != saved[False][0]                 # the norm is there
    assert saved[True][1] - saved[False][1] == b * s * (4 + 2 * 2) * 32 * 4    # fp32 bytes


# Presets ----------------------------------------------------------------------------------------

PUBLISHED = {   # parameters of the Hugging Face checkpoints (safetensors totals)
    "qwen3-0.6b": 596_049_920, "qwen3-4b": 4_022_468_096, "qwen3-8b": 8_190_735_360,
    "qwen2.5-7b": 7_615_616_512, "llama3.1-8b": 8_030_261_248, "llama3.2-1b": 1_235_814_400,
    "mistral-7b": 7_248_023_552,
    "qwen3-30b-a3b": 30_532_122_624, "mixtral-8x7b": 46_702_792_704,     # experts (issue 37)
    "qwen1.5-moe-a2.7b": 14_315_784_192,
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_family_presets_have_published_sizes(name):
    cfg = preset(name)
    assert cfg.num_parameters() == PUBLISHED[name]
    hf_config = families.llama_like_config(cfg, families.infer_family(cfg))
    with torch.device("meta"):   # the transformers model our export describes: the same count
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**hf_config))
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]


@pytest.mark.parametrize("name", ["qwen3-4b", "llama3.1-8b", "qwen2.5-7b"])
def test_family_flags_rebuild_the_config(name):
    """pretrain_gpt.py's flags (--qk-layernorm, --use-rope-scaling, --yarn-*) give the same model."""
    import sys
    sys.path.insert(0, ROOT)
    import pretrain_gpt
    from megatron_sp.cli.build import parse_job
    from megatron_sp.cli.model_flags import family_flags
    cfg = preset(name, position_embedding_type="yarn", use_rope_scaling=False,
                 yarn_rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=32768,
                 yarn_beta_fast=16.0) if name == "qwen3-4b" else preset(name)
    shape = (f"--num-layers {cfg.num_layers} --hidden-size {cfg.hidden_size} --num-attention-heads "
             f"{cfg.num_attention_heads} --num-query-groups {cfg.num_query_groups} --kv-channels "
             f"{cfg.kv_channels} --ffn-hidden-size {cfg.ffn_hidden_size} --max-position-embeddings "
             f"{cfg.max_position_embeddings} --position-embedding-type {cfg.position_embedding_type} "
             f"--rotary-base {cfg.rotary_base} --normalization RMSNorm --norm-epsilon "
             f"{cfg.norm_epsilon} --swiglu --disable-bias-linear --attention-dropout 0 "
             f"--hidden-dropout 0 --seq-length 128").split()
    shape += ["--add-qkv-bias"] if cfg.add_qkv_bias else []
    shape += [] if cfg.tie_embeddings else ["--untie-embeddings-and-output-weights"]
    job = parse_job(shape + family_flags(cfg))
    assert pretrain_gpt.model_config(job, cfg.vocab_size) == cfg


def test_family_presets_shapes():
    assert preset("qwen3-4b").kv_channels * preset("qwen3-4b").num_attention_heads == 4096 != 2560
    assert preset("qwen3-4b").tie_embeddings and preset("qwen3-4b").qk_layernorm
    assert preset("qwen2.5-7b").add_qkv_bias and not preset("qwen2.5-7b").add_bias_linear
    assert preset("llama3.1-8b").use_rope_scaling and preset("llama3.2-1b").rope_scaling_factor == 32
    assert families.infer_family(preset("qwen3-8b")) == "qwen3"
    assert families.infer_family(preset("qwen2.5-7b")) == "qwen2"


# GPT-2 BPE --------------------------------------------------------------------------------------

BPE_TEXTS = ["Hello world, this is a tiny corpus for a byte-level BPE.",
             "Tokenizers: über naïve café 日本語 🙂 <tags> & symbols !@#$%^*()",
             "  leading spaces\tand tabs\nnew lines  ", "numbers 12345 6789 and more words"]


@pytest.fixture(scope="module")
def bpe_files(tmp_path_factory):
    from tokenizers import ByteLevelBPETokenizer
    out = tmp_path_factory.mktemp("bpe")
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(BPE_TEXTS * 10, vocab_size=420, min_frequency=1,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    tok.save_model(str(out))
    return str(out / "vocab.json"), str(out / "merges.txt")


def test_gpt2_bpe_ids_equal_transformers(bpe_files):
    from megatron_sp.data import build_tokenizer
    vocab, merges = bpe_files
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    ref = transformers.GPT2Tokenizer(vocab, merges)
    assert ours.vocab_size == len(ref) and ours.eod == ref.eos_token_id == ref.convert_tokens_to_ids(
        "<|endoftext|>")
    probes = BPE_TEXTS + ["unseen wörds ✓ and <|endoftext|> between documents<|endoftext|>",
                          " a leading space", "", "\n\n\r\n", "x" * 50]
    for text in probes:
        ids = ours.tokenize(text)
        assert ids == ref(text).input_ids, text
        assert ours.detokenize(ids) == text


def test_gpt2_bpe_in_preprocessing_and_its_errors(bpe_files, tmp_path):
    import sys
    import numpy as np
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import preprocess_data
    from megatron_sp.data import build_tokenizer
    vocab, merges = bpe_files
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in BPE_TEXTS))
    assert preprocess_data.main(["--input", str(corpus), "--output-prefix", str(tmp_path / "out"),
                                 "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                                 "--merge-file", merges, "--append-eod"]) == 0
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    tokens = np.fromfile(tmp_path / "out_text_document.bin", dtype=np.uint16).tolist()
    assert tokens == [i for t in BPE_TEXTS for i in tok.tokenize(t) + [tok.eod]]
    with pytest.raises(ValueError, match="GPT2BPETokenizer needs --merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=None)

    # ... and trains in pretrain_gpt.py with the families' flags (qk-norm, head_dim, yarn).
    sys.path.insert(0, ROOT)
    import pretrain_gpt
    flags = ("--num-layers 1 --hidden-size 32 --num-attention-heads 4 --num-query-groups 2 "
             "--kv-channels 16 --ffn-hidden-size 64 --swiglu --normalization RMSNorm "
             "--disable-bias-linear --qk-layernorm --position-embedding-type yarn "
             "--yarn-rotary-scaling-factor 4 --yarn-original-max-position-embeddings 8 "
             "--seq-length 16 --max-position-embeddings 32 --micro-batch-size 2 "
             "--global-batch-size 2 --train-iters 2 --eval-iters 0 --attention-backend sdpa "
             "--log-interval 1 --split 100,0,0 --tokenizer-type GPT2BPETokenizer").split()
    metrics = tmp_path / "m.jsonl"
    pretrain_gpt.main(flags + ["--vocab-file", vocab, "--merge-file", merges, "--data-path",
                               str(tmp_path / "out_text_document"), "--data-cache-path",
                               str(tmp_path / "cache"), "--metrics-jsonl", str(metrics)])
    assert len(metrics.read_text().splitlines()) == 2


def _family_tokenizer_folders(bpe_files, tmp_path):
    """A Qwen-style folder (byte-level BPE, eos <|endoftext|>, chat tokens, no BOS) and a
    Llama-3-style one (BOS <|begin_of_text|> prepended by its post-processor, eos <|end_of_text|>),
    built from the BPE files trained above."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    vocab, merges = bpe_files
    folders = {}
    for name, specials, bos, eos in (
            ("qwen", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|endoftext|>"),
            ("llama3", ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"], "<|begin_of_text|>",
             "<|end_of_text|>")):
        tok = Tokenizer(models.BPE.from_file(vocab, merges))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(specials)
        if bos:
            bos_id = tok.token_to_id(bos)
            tok.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
        PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos).save_pretrained(
            tmp_path / name)
        folders[name] = (str(tmp_path / name), eos, bos)
    return folders


def test_family_tokenizer_folders_with_megatrons_eod(bpe_files, tmp_path):
    from megatron_sp.data import build_tokenizer
    for name, (folder, eos, bos) in _family_tokenizer_folders(bpe_files, tmp_path).items():
        ref = transformers.AutoTokenizer.from_pretrained(folder)
        ours = build_tokenizer("HuggingFaceTokenizer", folder)
        assert ours.eod == ref.convert_tokens_to_ids(eos) == ref.eos_token_id, name
        assert ours.vocab_size == len(ref)
        text = "Hello world, über 🙂<|im_end|>"
        ids = ours.tokenize(text)
        assert ids == ref(text).input_ids, name
        assert (ids[0] == ref.convert_tokens_to_ids(bos)) if bos else ids[0] != ours.eod


def test_vocab_size_pads_a_real_tokenizer_to_the_checkpoint_rows():
    """Qwen's checkpoints hold 151936 embedding rows for a tokenizer of 151669 ids: --vocab-size."""
    import sys
    sys.path.insert(0, ROOT)
    import pretrain_gpt
    from megatron_sp.cli.build import parse_job
    from megatron_sp.errors import ConfigError
    base = "--model qwen3-0.6b --seq-length 128 --tokenizer-type HuggingFaceTokenizer".split()
    assert pretrain_gpt.model_config(parse_job(base), 151669).vocab_size == 151669
    job = parse_job(base + ["--vocab-size", "151936"])
    assert pretrain_gpt.model_config(job, 151669).vocab_size == 151936
    with pytest.raises(ConfigError, match="--vocab-size 1000 is smaller than the HuggingFaceTokenizer"):
        pretrain_gpt.model_config(parse_job(base + ["--vocab-size", "1000"]), 151669)

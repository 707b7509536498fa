"""Hugging Face ``transformers`` models as their library writes them, against the
microbatch reference.

Each case builds a tiny random model from its config (no download) in training mode,
with every dropout and layer-drop probability set to 0 so that one sample alone and
the batch run the same function (and one with gradient checkpointing on). Each runs clipped (``max_grad_norm`` = the median
per-sample norm, so that about half the samples are clipped; no ``grad_sample``: the
ghost norms and clipped gradients a training run uses) in float64, and the results
are checked against ``tests/reference.py``'s loop: ``p.grad`` against the clipped sum,
``per_sample_norms`` on its own. A few cases also run with ``grad_sample=True``.

Models that compute parts in float32 whatever the model's dtype (Gemma 2's RMSNorm,
Mamba's selective scan, DeepSeek-V3's router) are exact to float32 rounding only: the batch and one sample
round differently.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

import pytest
import torch

import fxdp
from reference import assert_close_all, reference

transformers = pytest.importorskip("transformers", reason="Hugging Face models (the test extra)")

B, T, V = 3, 6, 32


def _config(name: str, **sizes: Any):
    """``transformers.<name>(**sizes)`` with every dropout probability 0."""
    config = getattr(transformers, name)(**sizes)
    for key, value in vars(config).items():
        if isinstance(value, float) and any(w in key for w in ("dropout", "pdrop", "layerdrop", "drop_path")):
            setattr(config, key, 0.0)
    return config


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(seed))


def _with_image_tokens(token: int, count: int) -> torch.Tensor:
    """Tokens with ``count`` image tokens in every sample (from position 1)."""
    ids = _tokens()
    ids[ids == token] = 1
    ids[:, 1:1 + count] = token
    return ids


def _images(*shape: int) -> torch.Tensor:
    return torch.randn(B, *shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    model: str  # the transformers class
    config: str  # its config class
    sizes: dict
    inputs: Callable[[], tuple]
    tol: float = 1e-9  # of max |ref|
    grad_sample: bool = False  # also run with grad_sample=True
    checkpointing: bool = False  # gradient_checkpointing_enable()
    warm: bool = False  # called once on one sample first (transformers' lock on a first call, see below)

    def build(self) -> torch.nn.Module:
        torch.manual_seed(0)
        model = getattr(transformers, self.model)(_config(self.config, **self.sizes)).double().train()
        if self.checkpointing:
            model.gradient_checkpointing_enable()  # non-reentrant checkpoints
        return model


DECODER = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2)
ENCODER = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
               max_position_embeddings=16)
VISION = dict(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2,
              num_attention_heads=2)
MOE = dict(DECODER, num_local_experts=4, num_experts_per_tok=2)
SEQ2SEQ = dict(vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
               decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32)

CASES = [
    # Conv1D's addmm with [in, out] weights, tied wte/lm_head, wpe(arange(T))
    Case("gpt2", "GPT2LMHeadModel", "GPT2Config", dict(vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=16),
         lambda: (_tokens(),), grad_sample=True),
    # multi-query attention
    Case("gpt_bigcode", "GPTBigCodeForCausalLM", "GPTBigCodeConfig",
         dict(vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=16, multi_query=True), lambda: (_tokens(),)),
    # RoPE, RMSNorm, grouped-query SDPA, SwiGLU
    Case("llama", "LlamaForCausalLM", "LlamaConfig", DECODER, lambda: (_tokens(),), grad_sample=True),
    # every decoder layer checkpointed (its output collected inside the checkpoint)
    Case("llama_checkpointed", "LlamaForCausalLM", "LlamaConfig", DECODER, lambda: (_tokens(),), checkpointing=True),
    # a sliding-window causal mask
    Case("mistral", "MistralForCausalLM", "MistralConfig", dict(DECODER, sliding_window=4), lambda: (_tokens(),)),
    # soft-capped attention and logits, (1 + w) RMSNorm in float32, scaled embeddings
    Case("gemma2", "Gemma2ForCausalLM", "Gemma2Config", dict(DECODER, head_dim=4, sliding_window=4),
         lambda: (_tokens(),), tol=1e-6),
    # partial rotary, parallel attention and MLP
    Case("gpt_neox", "GPTNeoXForCausalLM", "GPTNeoXConfig",
         dict(ENCODER, rotary_pct=0.5), lambda: (_tokens(),)),
    # learned positions with an offset, a projection of the embeddings
    Case("opt", "OPTForCausalLM", "OPTConfig",
         dict(vocab_size=V, hidden_size=16, ffn_dim=32, num_hidden_layers=2, num_attention_heads=2,
              max_position_embeddings=16, word_embed_proj_dim=16), lambda: (_tokens(),)),
    # token types, absolute positions, the MLM head tied to the embeddings
    Case("bert", "BertForMaskedLM", "BertConfig", ENCODER, lambda: (_tokens(),), grad_sample=True),
    # disentangled relative attention (gathers of relative positions)
    Case("deberta_v2", "DebertaV2Model", "DebertaV2Config",
         dict(ENCODER, relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"]),
         lambda: (_tokens(),)),
    # rotary positions of a protein language model
    Case("esm", "EsmForMaskedLM", "EsmConfig",
         dict(ENCODER, position_embedding_type="rotary", pad_token_id=0, mask_token_id=1), lambda: (_tokens(),)),
    # bucketed relative position bias, encoder-decoder
    Case("t5", "T5ForConditionalGeneration", "T5Config",
         dict(vocab_size=V, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4,
              relative_attention_num_buckets=8, decoder_start_token_id=0),
         lambda: (_tokens(), None, _tokens(seed=2))),
    # conv1d front end over mel frames, sinusoidal encoder positions, a decoder
    Case("whisper", "WhisperModel", "WhisperConfig",
         dict(SEQ2SEQ, num_mel_bins=8, max_source_positions=8, max_target_positions=16, pad_token_id=0,
              decoder_start_token_id=1),
         lambda: (_images(8, 16), None, _tokens(seed=2))),
    # a conv feature encoder with GroupNorm, a weight-normed positional conv
    Case("wav2vec2", "Wav2Vec2Model", "Wav2Vec2Config",
         dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, conv_dim=(8, 8),
              conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4,
              num_conv_pos_embedding_groups=2, feat_extract_norm="group", mask_time_prob=0.0),
         lambda: (_images(200),)),
    # patch conv, cls_token, position table
    Case("vit", "ViTModel", "ViTConfig", dict(VISION, intermediate_size=32), lambda: (_images(3, 8, 8),),
         grad_sample=True),
    # relative position bias table, layer scale, mean pooling
    Case("beit", "BeitModel", "BeitConfig",
         dict(VISION, intermediate_size=32, use_relative_position_bias=True, layer_scale_init_value=0.1,
              use_mean_pooling=True), lambda: (_images(3, 8, 8),)),
    # shifted windows: rolls, window partitions, a relative position index
    Case("swin", "SwinModel", "SwinConfig",
         dict(image_size=16, patch_size=2, num_channels=3, embed_dim=8, depths=[1, 1], num_heads=[2, 2],
              window_size=4), lambda: (_images(3, 16, 16),)),
    # depthwise 7x7 convs, channels-last LayerNorm, layer scale
    Case("convnext", "ConvNextModel", "ConvNextConfig",
         dict(num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2), lambda: (_images(3, 16, 16),)),
    # patches of a time series, standard scaling over time
    Case("patchtst", "PatchTSTModel", "PatchTSTConfig",
         dict(num_input_channels=2, context_length=16, patch_length=4, patch_stride=4, d_model=16,
              num_attention_heads=2, num_hidden_layers=1, ffn_dim=32, norm_type="layernorm", do_mask_input=False,
              scaling="std"), lambda: (_images(16, 2),)),
    # a vision-language model: CLIP's patch features projected, then scattered into each
    # sample's image tokens (masked_scatter) after a batch-wide count check
    Case("llava", "LlavaForConditionalGeneration", "LlavaConfig",
         dict(vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32,
                                 num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=8,
                                 projection_dim=16, attention_dropout=0.0, dropout=0.0),
              text_config=dict(model_type="llama", vocab_size=V, hidden_size=16, intermediate_size=32,
                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                               max_position_embeddings=16, attention_dropout=0.0),
              image_token_id=V - 1, projector_hidden_act="gelu", vision_feature_select_strategy="default",
              vision_feature_layer=-1),
         lambda: (_with_image_tokens(V - 1, 4), _images(3, 16, 16)), grad_sample=True, warm=True),
    # a selective scan written in PyTorch (the slow path: no CUDA kernels), causal conv1d
    Case("mamba", "MambaModel", "MambaConfig",
         dict(vocab_size=V, hidden_size=16, state_size=4, num_hidden_layers=1, expand=2, conv_kernel=3),
         lambda: (_tokens(),), tol=1e-6),
    # mixtures of experts with transformers' dense batched_mm experts (its default grouped_mm
    # ones: test_rules_grouped.py)
    Case("mixtral_batched_mm", "MixtralForCausalLM", "MixtralConfig", dict(MOE, experts_implementation="batched_mm"),
         lambda: (_tokens(),), grad_sample=True),
    # a shared expert behind a sigmoid gate beside the routed ones
    Case("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
         dict(DECODER, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
              shared_expert_intermediate_size=16, experts_implementation="batched_mm"), lambda: (_tokens(),)),
    # multi-head latent attention, group-limited routing with a float32 router, a dense first layer
    Case("deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3Config",
         dict(DECODER, num_key_value_heads=4, head_dim=4, moe_intermediate_size=16, n_routed_experts=4,
              num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=8,
              q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4,
              experts_implementation="batched_mm"), lambda: (_tokens(),), tol=1e-6),
]


def _loss(out: Any) -> torch.Tensor:
    """The sum over samples of each one's squared output (the logits where there are)."""
    logits = getattr(out, "logits", None)
    return (out.last_hidden_state if logits is None else logits).pow(2).sum()


RUNS = [(c, False) for c in CASES] + [(c, True) for c in CASES if c.grad_sample]


@pytest.mark.parametrize(("case", "grad_sample"), RUNS,
                         ids=[f"{c.id}-{'grad_sample' if g else 'clip'}" for c, g in RUNS])
def test_hugging_face_model_is_exact(case: Case, grad_sample: bool):
    model = case.build()
    args = case.inputs()
    ref = reference(model, args, lambda out, i: _loss(out))
    clip = float(ref.norms.median())
    trained = copy.deepcopy(model)
    if case.warm:
        # transformers 5 takes a threading lock on a model's first call that asks for hidden
        # states (LLaVA's vision tower does), which Dynamo cannot capture; fxdp's refusal
        # says to call the model once first, as here.
        with torch.no_grad():
            trained(*(a[:1] for a in args))
    dp_model = fxdp.transform(trained, max_grad_norm=clip, grad_sample=grad_sample, loss_reduction="sum",
                              compiler="eager")
    _loss(dp_model(*args)).backward()
    # A parameter the forward does not use (ESM's contact head) gets no gradient, as in
    # PyTorch; the loop's is zero.
    params = {n: p for n, p in trained.named_parameters() if p.grad is not None}
    unused = [n for n in ref.names if n not in params]
    assert all(not ref.per_sample[n].any() for n in unused), f"no gradient for {unused}"
    used = [n for n in ref.names if n in params]
    clipped = ref.grad("sum", clip)
    assert_close_all({n: params[n].grad for n in used}, {n: clipped[n] for n in used}, case.tol, "p.grad")
    assert_close_all({"norms": dp_model.per_sample_norms}, {"norms": ref.norms}, case.tol, "per_sample_norms")
    if grad_sample:
        assert_close_all({n: params[n].grad_sample for n in used}, {n: ref.per_sample[n] for n in used}, case.tol,
                         "p.grad_sample")


def test_transformers_eager_experts_are_refused_with_the_setting_to_use():
    """transformers' eager experts loop over the experts some token chose, a loop whose
    length the data decides (Dynamo cannot capture it, with or without fxdp); the refusal
    names the experts implementations fxdp follows."""
    case = Case("mixtral_eager", "MixtralForCausalLM", "MixtralConfig", dict(MOE, experts_implementation="eager"),
                lambda: (_tokens(),))
    dp_model = fxdp.transform(case.build(), max_grad_norm=1.0, compiler="eager")
    with pytest.raises(fxdp.UnsupportedError, match='a loop over the values of a tensor.*'
                       'experts_implementation="grouped_mm"'):
        dp_model(*case.inputs())

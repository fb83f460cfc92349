"""The training recipe: the model's shape (DeepSeek-V3 field names) and the optimisation settings, frozen.

Dimension letters as in engine/model/config.py: d hidden, h heads, q q_lora_rank, c kv_lora_rank,
n qk_nope_head_dim, r qk_rope_head_dim, v v_head_dim, e routed experts, f moe_intermediate_size,
F intermediate_size (dense MLP), V vocab.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from .errors import TrainError


@dataclass(frozen=True)
class ModelShape:
    """A DeepseekV3ForCausalLM with every Kimi K2 / DeepSeek-V3 feature on.

    # embedding / blocks
    vocab_size (set from the tokenizer), hidden_size, num_hidden_layers, first_k_dense_replace (>= 1 dense
    SwiGLU layers of intermediate_size first), rms_norm_eps
    # mla (q LoRA on)
    num_attention_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim,
    attention_dropout
    # moe (sigmoid + e_score_correction_bias, group-limited noaux_tc, shared expert)
    n_routed_experts, num_experts_per_tok, n_group (> 1), topk_group (< n_group), n_shared_experts,
    moe_intermediate_size, routed_scaling_factor, norm_topk_prob
    # yarn rope (factor = max_position_embeddings / original_max_position_embeddings > 1)
    rope_theta, max_position_embeddings, original_max_position_embeddings, beta_fast, beta_slow,
    mscale, mscale_all_dim
    """

    vocab_size: int
    hidden_size: int = 256
    num_hidden_layers: int = 5
    first_k_dense_replace: int = 1
    intermediate_size: int = 1024
    rms_norm_eps: float = 1e-6
    num_attention_heads: int = 4
    q_lora_rank: int = 128
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    attention_dropout: float = 0.1
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_group: int = 4
    topk_group: int = 2
    n_shared_experts: int = 1
    moe_intermediate_size: int = 152
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    original_max_position_embeddings: int = 512
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

    def __post_init__(self) -> None:
        if self.q_lora_rank < 1:
            raise TrainError(f"q_lora_rank must be positive (q LoRA on), got {self.q_lora_rank}")
        if not 1 <= self.first_k_dense_replace < self.num_hidden_layers:
            raise TrainError(f"first_k_dense_replace must be in 1..num_hidden_layers-1, got "
                             f"{self.first_k_dense_replace}")
        if self.n_group < 2 or self.n_routed_experts % self.n_group or self.n_routed_experts // self.n_group < 2:
            raise TrainError(f"group-limited routing needs n_group >= 2 dividing n_routed_experts into groups of "
                             f">= 2, got {self.n_routed_experts} experts in {self.n_group} groups")
        if not 1 <= self.topk_group < self.n_group:
            raise TrainError(f"topk_group must be in 1..n_group-1, got {self.topk_group}")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise TrainError(f"num_experts_per_tok {self.num_experts_per_tok} exceeds the experts in "
                             f"topk_group groups")
        if self.n_shared_experts < 1:
            raise TrainError("n_shared_experts must be >= 1")
        if self.yarn_factor <= 1:
            raise TrainError(f"YaRN factor (max_position_embeddings / original) must be > 1, got {self.yarn_factor}")
        if self.qk_rope_head_dim % 2:
            raise TrainError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    @property
    def yarn_factor(self) -> float:
        return self.max_position_embeddings / self.original_max_position_embeddings

    def rope_parameters(self) -> dict:
        return {"rope_type": "yarn", "rope_theta": self.rope_theta, "factor": self.yarn_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "beta_fast": self.beta_fast, "beta_slow": self.beta_slow, "mscale": self.mscale,
                "mscale_all_dim": self.mscale_all_dim}

    def hf_config_kwargs(self, eod_id: int) -> dict:
        """Keyword arguments of ``transformers.DeepseekV3Config``: EOD doubles as bos and eos. No pad id: HF's
        embedding would zero the pad row and freeze it (``padding_idx``), and EOD opens every document."""
        fields = {k: v for k, v in asdict(self).items()
                  if k not in ("rope_theta", "original_max_position_embeddings", "beta_fast", "beta_slow",
                               "mscale", "mscale_all_dim")}
        return {**fields, "num_key_value_heads": self.num_attention_heads, "rope_parameters": self.rope_parameters(),
                "rope_interleave": True, "tie_word_embeddings": False, "bos_token_id": eod_id,
                "eos_token_id": eod_id, "pad_token_id": None, "num_nextn_predict_layers": 0}

    def parameter_count(self) -> int:
        """Every parameter the model holds (the e_score_correction_bias buffers included)."""
        d, h, q, c = self.hidden_size, self.num_attention_heads, self.q_lora_rank, self.kv_lora_rank
        n, r, v = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        e, f = self.n_routed_experts, self.moe_intermediate_size
        attention = d * q + q + q * h * (n + r) + d * (c + r) + c + c * h * (n + v) + h * v * d
        dense = 3 * d * self.intermediate_size
        moe = e * d + e + 3 * d * f * (e + self.n_shared_experts)
        norms = 2 * d
        dense_layers = self.first_k_dense_replace
        moe_layers = self.num_hidden_layers - dense_layers
        return 2 * self.vocab_size * d + d + dense_layers * (attention + dense + norms) + \
            moe_layers * (attention + moe + norms)


@dataclass(frozen=True)
class OptimRecipe:
    """How the model is trained.

    # data: random windows of ``context`` tokens from the training stream, ``batch_size`` per step
    # optimiser: AdamW (decay on matrices only), linear warmup then cosine to min_lr_ratio * lr over the time
      budget (or max_steps when set), gradient clipping, bf16 autocast
    # balance: aux-loss-free bias update rate (DeepSeek-V3's gamma)
    # regularisation: weight_decay, ModelShape.attention_dropout, embedding_dropout (on the embedding output,
      training only)
    # evaluation every eval_interval_s of training; stop after ``patience`` evaluations without a better
      held-out loss
    """

    context: int = 1024
    batch_size: int = 32
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    bias_update_rate: float = 1e-3
    embedding_dropout: float = 0.1
    eval_interval_s: float = 10.0
    eval_batch_size: int = 32
    patience: int = 8
    sample_new_tokens: int = 96
    autocast_bf16: bool = True

    def __post_init__(self) -> None:
        for name in ("context", "batch_size", "eval_batch_size", "patience"):
            if getattr(self, name) < 1:
                raise TrainError(f"{name} must be positive, got {getattr(self, name)}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup_steps < 0:
            raise TrainError("lr must be positive, min_lr_ratio in 0..1, warmup_steps >= 0")


# The shipped model's shape (vocab_size set from the tokenizer) and a CPU-test-sized one.
PYCODER_MINI = ModelShape(vocab_size=4096)
SMOKE = ModelShape(vocab_size=300, hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=2,
                   q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                   n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=16,
                   max_position_embeddings=1024, original_max_position_embeddings=256)
SHAPES = {"pycoder-mini": PYCODER_MINI, "smoke": SMOKE}
SMOKE_OPTIM = OptimRecipe(context=64, batch_size=4, warmup_steps=2, eval_interval_s=0.0, eval_batch_size=8,
                          sample_new_tokens=8)
OPTIMS = {"pycoder-mini": OptimRecipe(), "smoke": SMOKE_OPTIM}


def with_vocab(shape: ModelShape, vocab_size: int) -> ModelShape:
    return replace(shape, vocab_size=vocab_size)

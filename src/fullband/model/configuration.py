"""``FullBandwidthConfig``: a Hugging Face config that holds the backbone's config and the feedback settings.

The backbone config lives under ``text_config`` (so Hugging Face utilities that look for a composite model's
text config, the KV-cache builders of ``generate()`` among them, find it); ``backbone_config`` is an alias.
"""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig
from transformers.configuration_utils import SubConfigSpec

from .feedback import check_fusion_name

# the one mode vocabulary: how a model is run. Decode modes say how the prompt is treated before generation
# (every generated token is fused in all but ``standard``); scoring adds ``passes`` (the K-pass teacher-forced
# forward of training).
DECODE_MODES = ("standard", "soft", "fused", "exact")
FEEDBACK_MODES = tuple(m for m in DECODE_MODES if m != "standard")
SCORING_MODES = ("standard", "passes", "exact", "soft", "fused")


def has_feedback(model) -> bool:
    """Whether ``model`` has latent feedback (a fullband model: a fusion module around a backbone) rather than being
    a plain causal LM. The one test the package uses."""
    return isinstance(getattr(model, "config", None), FullBandwidthConfig) and getattr(model, "feedback", None) is not None


class FullBandwidthConfig(PretrainedConfig):
    """Config of a :class:`~fullband.FullBandwidthForCausalLM`.

    Args:
        text_config: the wrapped causal LM's config (any decoder-only ``AutoModelForCausalLM`` family).
        fusion: ``"residual"`` (default: ``u = e + GLU(h, e)``, the token kept on the input path and exactly the
            plain model at switch-on; measured best by ``fullband experiment recipe``), ``"glu"`` (paper Eq. 4), or
            the ablations ``"concat"`` and ``"add"``.
        feedback_weight: λ in ``loss = L_1 + λ · mean(L_2..L_K)``.
        jitter: training-only uniform noise on the fed-back state, ``±jitter · RMS(state)`` per vector.
        detach_state: not in the paper; stop gradients through the fed-back state (pass k's loss then trains
            pass k only). It saves little: measured by ``fullband bench train``, a K=2 step with it cost about the
            same as without (pass 1's backward is needed for L_1 anyway).
        embed_rms: RMS of the backbone's token embeddings when the fusion was built; the fused input is
            initialised to this scale. Measured automatically when left ``None``.
        doc_start_token_id: token that starts a document (no feedback there); defaults to the backbone's BOS.
        default_feedback_mode: decode mode ``generate()`` uses when none is given: ``fused`` (one Jacobi pass over
            the prompt, then feedback on every generated token), chosen from held-out measurements (see
            :mod:`fullband.generation`): it matched ``exact`` and beat ``soft`` on every model measured, at a
            fraction of ``exact``'s prompt latency.
    """

    model_type = "fullband"
    sub_configs_defaults = {"text_config": SubConfigSpec(config_class=AutoConfig, model_type="llama")}

    text_config: dict | PretrainedConfig | None = None
    fusion: str = "residual"
    feedback_weight: float = 1.0
    jitter: float = 0.02
    detach_state: bool = False
    embed_rms: float | None = None
    doc_start_token_id: int | None = None
    default_feedback_mode: str = "fused"
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        check_fusion_name(self.fusion)
        if self.default_feedback_mode not in DECODE_MODES:
            raise ValueError(f"unknown default_feedback_mode {self.default_feedback_mode!r}: choose one of "
                             f"{', '.join(DECODE_MODES)}")
        if self.jitter < 0:
            raise ValueError(f"jitter must be >= 0, got {self.jitter}")
        if self.doc_start_token_id is None:
            self.doc_start_token_id = getattr(self.text_config, "bos_token_id", None)
        # the backbone decides tying of its own lm_head; this wrapper has no head of its own
        self.tie_word_embeddings = False

    @property
    def backbone_config(self) -> PretrainedConfig:
        return self.text_config

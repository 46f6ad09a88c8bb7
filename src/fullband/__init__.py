"""fullband: the full-bandwidth transformer (latent feedback) on Hugging Face causal LMs.

Importing the package registers ``FullBandwidthConfig`` / ``FullBandwidthForCausalLM`` with ``AutoConfig`` and
``AutoModelForCausalLM`` so that ``AutoModelForCausalLM.from_pretrained(dir)`` returns a fullband model.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from .model.configuration import FullBandwidthConfig
from .model.feedback import build_feedback_mask, document_starts, prefix_mixing_mask, prefix_row_seeds
from .model.modeling import FullBandwidthForCausalLM, FullBandwidthOutput
from .model.objective import combine_pass_losses
from .training.schedule import FeedbackSchedule

__version__ = "0.1.0"

AutoConfig.register(FullBandwidthConfig.model_type, FullBandwidthConfig, exist_ok=True)
AutoModelForCausalLM.register(FullBandwidthConfig, FullBandwidthForCausalLM, exist_ok=True)

__all__ = [
    "FullBandwidthConfig", "FullBandwidthForCausalLM", "FullBandwidthOutput", "FeedbackSchedule",
    "combine_pass_losses", "build_feedback_mask", "document_starts", "prefix_mixing_mask", "prefix_row_seeds", "__version__",
]

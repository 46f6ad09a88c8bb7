"""What the fed-back state carries (``fullband analyze``): runs and interventions (:mod:`.runs`), probes, logit lens
and gates (:mod:`.probes`), the whole analysis and its report (:mod:`.report`)."""

from .probes import PROBE_TARGETS, gate_statistics, layer_probes, logit_lens, ridge_probe
from .report import AnalyzeOptions, analyze_models, run_analysis, write_report
from .runs import (
                   INTERVENTIONS,
                   RunRecord,
                   analysis_rows,
                   collect,
                   final_norm,
                   load_bearing,
                   other_doc_index,
                   passes_forward,
                   probe_selection,
                   recurrence,
                   shuffle_index,
                   substitute_states,
)

__all__ = ["PROBE_TARGETS", "gate_statistics", "layer_probes", "logit_lens", "ridge_probe", "AnalyzeOptions",
           "analyze_models", "run_analysis", "write_report", "INTERVENTIONS", "RunRecord", "analysis_rows", "collect",
           "final_norm", "load_bearing", "other_doc_index", "passes_forward", "probe_selection", "recurrence",
           "shuffle_index", "substitute_states"]

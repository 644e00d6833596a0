"""IFEval scoring for ifeval.yaml: lm-eval's own functions, imported after the offline NLTK patch."""

from qrecover.evaluate.ifeval_offline import install

install()

from lm_eval.tasks.ifeval.utils import agg_inst_level_acc, process_results  # noqa: E402

__all__ = ["agg_inst_level_acc", "process_results"]

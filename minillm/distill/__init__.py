"""Knowledge distillation from scratch: a pruned student learns a teacher's behaviour on one focused task.

    tasks.py      the support-message tasks (extract fields as JSON, classify the intent), seeded, with a held-out split
    teacher.py    the teacher's greedy answers through minillm's engine, then its logits on them
    student.py    choosing layers, building the student from the teacher's weights, saving an HF directory
    loss.py       the distillation loss (KL on softened logits x T^2, mixed with cross-entropy) and its reference
    train.py      the training loop, top-1 agreement, the plotly loss curve
    evaluate.py   the task's scores (field / intent accuracy, valid JSON) beside the teacher's
    pipeline.py   one run end to end: `distill(DistillRecipe(...), out_dir)`
    export_gguf.py   a model to GGUF (F16 / Q8_0 / Q4_0) with its tokenizer, and an Ollama Modelfile
    sweep.py      student depth x weight_dtype beside the teacher: score, tok/s, TTFT, memory, $/Mtok, the Pareto
                  front and the pick (the cheapest point within a margin of the teacher's score)
    memory.py     weights + KV cache at a context against devices' RAM, the bandwidth bound on tok/s
    ondevice.py   the student as the teacher's draft model (beside n-gram and self-draft); llama.cpp on its GGUF
"""

from .loss import distillation_loss, distillation_loss_parts, reference_distillation_loss
from .student import build_student, save_student, select_layers
from .tasks import INTENTS, TASKS, make_examples

__all__ = ["INTENTS", "TASKS", "build_student", "distillation_loss", "distillation_loss_parts", "make_examples",
           "reference_distillation_loss", "save_student", "select_layers"]

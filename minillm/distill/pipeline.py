"""One distillation run end to end: teacher data, the student, training, the saved directory and the held-out report.

    result = distill(DistillRecipe(task="extract", num_layers=6), out_dir="students/extract-6")
    result.report        the held-out table: the teacher, the pruned student untrained, the student trained on
                         the task's labels alone, the distilled student (with compare=True)
    result.path          an HF directory that LLM(path) and transformers both load

Every student starts from the same pruned copy of the teacher and sees the same messages, steps, seed and
learning rate; only the targets differ: the distilled student learns the teacher's greedy answers and its
softened logits (KL x T^2 mixed with cross-entropy), the labels-only student the true answers with
cross-entropy alone. The teacher reads a few-shot prompt; students read the short one.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable

from ..llm import LLM
from .evaluate import format_report, generate_answers, score_answers
from .student import build_student, load_teacher, save_student, select_layers
from .tasks import check_task, make_examples
from .teacher import decode_answer, label_items, teacher_answers, teacher_items
from .train import plot_loss_curves, top1_agreement, train_student


@dataclasses.dataclass(frozen=True)
class DistillRecipe:
    """Everything that decides a student: the teacher, the task, the student's shape and the training."""
    task: str = "extract"
    teacher: str | None = None          # an HF directory; None: the default model (SmolLM2-135M-Instruct)
    adapter: str | None = None          # a PEFT adapter directory merged into the teacher (the task specialist)
    num_layers: int = 6
    layer_strategy: str = "spread"
    intermediate_size: int | None = None
    num_train: int = 96
    num_heldout: int = 48
    steps: int = 60
    batch_size: int = 8
    lr: float = 1e-3
    temperature: float = 2.0
    alpha: float = 0.5                  # 1: KL only, 0: cross-entropy on the teacher's tokens only
    seed: int = 0
    max_answer_tokens: int = 48         # the teacher's answers stop at a newline or here

    def check(self) -> None:
        check_task(self.task)
        for name, low, high in (("num_train", 1, 5000), ("num_heldout", 1, 5000), ("num_layers", 1, 1000),
                                ("max_answer_tokens", 1, 512)):
            value = getattr(self, name)
            if not low <= value <= high:
                raise ValueError(f"{name}={value} is outside {low}..{high}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha={self.alpha} must be in [0, 1] (1: KL only, 0: cross-entropy only)")
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature} must be > 0")


@dataclasses.dataclass
class DistillResult:
    path: Path
    keep_layers: list[int]
    rows: dict[str, dict]               # the held-out scores per model
    histories: dict[str, list[dict]]    # the loss per step per trained student
    seconds: dict[str, float]           # wall time of each phase
    report: str

    def loss_figure(self):
        return plot_loss_curves(self.histories)


def _params_m(model) -> float:
    return sum(p.numel() for p in model.parameters()) / 1e6


def _teacher_dir(recipe: DistillRecipe) -> Path:
    if recipe.teacher is not None:
        return Path(recipe.teacher)
    from ..models.default import default_model_path

    return Path(default_model_path())


@dataclasses.dataclass
class TeacherData:
    """What every student of one recipe learns from: the teacher's answers and logits, the held-out messages."""
    teacher_dir: Path
    teacher: object                     # the transformers model (students are cut from it)
    tokenizer: object
    pad_id: int
    train: list
    heldout: list
    items: list                         # TrainingItems with the teacher's logits
    eval_items: list                    # the held-out teacher answers (for top-1 agreement)
    teacher_row: dict                   # the teacher's held-out scores
    seconds: dict[str, float]


def prepare(recipe: DistillRecipe, progress: bool = True) -> TeacherData:
    """The teacher's answers on the training and held-out messages (one batched run) and its logits on the training ones."""
    recipe.check()
    seconds, clock = {}, time.perf_counter()
    teacher_dir = _teacher_dir(recipe)
    teacher = load_teacher(teacher_dir, recipe.adapter)
    teacher_llm = LLM(str(teacher_dir), **({"enable_lora": True} if recipe.adapter else {}))
    lora = None
    if recipe.adapter:
        from ..lora import LoRARequest

        lora = LoRARequest("teacher-adapter", 1, str(recipe.adapter))
    tokenizer = teacher_llm.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    train = make_examples(recipe.task, "train", recipe.num_train)
    heldout = make_examples(recipe.task, "heldout", recipe.num_heldout)
    answers = teacher_answers(teacher_llm, recipe.task, train + heldout, lora, progress, recipe.max_answer_tokens)
    train_answers, heldout_answers = answers[:len(train)], answers[len(train):]
    seconds["teacher answers"] = time.perf_counter() - clock
    teacher_texts = [decode_answer(tokenizer, a) for a in heldout_answers]
    row = {**score_answers(recipe.task, heldout, teacher_texts), "agreement": 1.0,
           "layers": teacher.config.num_hidden_layers, "params_m": _params_m(teacher)}
    clock = time.perf_counter()
    items = teacher_items(teacher, tokenizer, recipe.task, train, train_answers, progress=progress)
    eval_items = teacher_items(teacher, tokenizer, recipe.task, heldout, heldout_answers, with_logits=False)
    seconds["teacher logits"] = time.perf_counter() - clock
    return TeacherData(teacher_dir, teacher, tokenizer, pad_id, train, heldout, items, eval_items, row, seconds)


def picked_layers(layer_picker: Callable | None, num_layers: int, num_keep: int, strategy: str = "spread") -> list[int]:
    """The layers a student keeps: `select_layers`, or layer_picker(num_layers, num_keep) checked (ascending,
    distinct, num_keep of them, each in 0..num_layers - 1)."""
    if layer_picker is None:
        return select_layers(num_layers, num_keep, strategy)
    keep = layer_picker(num_layers, num_keep)
    if (not isinstance(keep, (list, tuple)) or len(keep) != num_keep or not all(isinstance(i, int) for i in keep)
            or list(keep) != sorted(set(keep)) or not all(0 <= i < num_layers for i in keep)):
        raise ValueError(f"layer_picker({num_layers}, {num_keep}) returned {keep!r}; expected {num_keep} distinct "
                         f"layer indices in 0..{num_layers - 1}, ascending")
    return list(keep)


def distill(recipe: DistillRecipe, out_dir: str | Path, compare: bool = False, progress: bool = True,
            generate: bool = True, data: TeacherData | None = None, loss_fn: Callable | None = None,
            layer_picker: Callable | None = None) -> DistillResult:
    """Distil a student into `out_dir`; compare=True also trains the labels-only student and scores the pruned one.
    generate=False scores students by top-1 agreement only (no held-out answers generated: quicker).
    data: the teacher's data of an earlier `prepare` (same task and messages), to distil several students from it.
    loss_fn / layer_picker: your own loss (see `train_student`) and layer choice ``(num_layers, num_keep) -> [i]``
    in place of the built-in ones (lab 12 plugs its exercises in here)."""
    recipe.check()
    data = data if data is not None else prepare(recipe, progress)
    seconds = dict(data.seconds)
    teacher, tokenizer, pad_id, heldout = data.teacher, data.tokenizer, data.pad_id, data.heldout
    keep = picked_layers(layer_picker, teacher.config.num_hidden_layers, recipe.num_layers, recipe.layer_strategy)
    rows = {"teacher": dict(data.teacher_row)}

    def fit(name: str, train_items, alpha: float) -> tuple:
        student = build_student(teacher, keep, recipe.intermediate_size)
        start = time.perf_counter()
        history = train_student(student, train_items, recipe.steps, recipe.batch_size, recipe.lr, recipe.temperature,
                                alpha, recipe.seed, pad_id=pad_id, progress=progress, desc=name,
                                loss_fn=loss_fn) if train_items else []
        seconds[f"train {name}"] = time.perf_counter() - start
        return student, history

    def score(name: str, student) -> None:
        path = save_student(student, data.teacher_dir,
                            Path(out_dir) if name == "distilled" else Path(out_dir) / f".{name}",
                            {"recipe": dataclasses.asdict(recipe), "keep_layers": keep, "student": name})
        scores = dict.fromkeys(("score", "valid_json", "exact"))
        if generate:
            start = time.perf_counter()
            texts = generate_answers(LLM(str(path)), recipe.task, heldout, max_tokens=recipe.max_answer_tokens)
            scores = score_answers(recipe.task, heldout, texts)
            seconds[f"score {name}"] = time.perf_counter() - start
        rows[f"student {name}"] = {**scores,
                                   "agreement": top1_agreement(student, data.eval_items, pad_id=pad_id),
                                   "layers": len(keep), "params_m": _params_m(student)}

    histories = {}
    if compare:
        score("pruned", fit("pruned", [], 0.0)[0])
        labelled, histories["labels only"] = fit("labels only", label_items(tokenizer, recipe.task, data.train), 0.0)
        score("labels only", labelled)
    distilled, histories["distilled"] = fit("distilled", data.items, recipe.alpha)
    score("distilled", distilled)
    report = format_report(recipe.task, rows)
    manifest = {"recipe": dataclasses.asdict(recipe), "keep_layers": keep, "student": "distilled",
                "heldout": rows, "seconds": seconds}
    save_student(distilled, data.teacher_dir, out_dir, manifest)
    return DistillResult(Path(out_dir), keep, rows, histories, seconds, report)


def distill_depths(recipe: DistillRecipe, depths: list[int], out_root: str | Path, progress: bool = True,
                   data: TeacherData | None = None, loss_fn: Callable | None = None,
                   layer_picker: Callable | None = None) -> dict[int, DistillResult]:
    """One distilled student per depth (layers kept), all from one run of the teacher: `<out_root>/<task>-<depth>`."""
    if not depths or len(set(depths)) != len(depths):
        raise ValueError(f"depths={depths} must be distinct layer counts (at least one)")
    data = data if data is not None else prepare(recipe, progress)
    return {depth: distill(dataclasses.replace(recipe, num_layers=depth), Path(out_root) / f"{recipe.task}-{depth}",
                           progress=progress, data=data, loss_fn=loss_fn, layer_picker=layer_picker)
            for depth in depths}

"""`minillm distill`: distil a student for a task and print it beside its teacher; `minillm distill export`: to GGUF.

    minillm distill --task extract --layers 6 --out students/extract-6 [--compare] [--plot loss.html]
    minillm distill export students/extract-6 --type q8_0 --out exports/
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys


def _in_range(name: str, low, high, kind=int):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} {text!r} is not a number ({low}..{high})") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{name} {value} is outside {low}..{high}")
        return value
    return parse


def cmd_distill(args) -> int:
    from ..distill.pipeline import DistillRecipe, distill

    recipe = DistillRecipe(task=args.task, teacher=args.teacher, adapter=args.adapter, num_layers=args.layers,
                           layer_strategy=args.strategy, intermediate_size=args.intermediate_size,
                           num_train=args.train, num_heldout=args.heldout, steps=args.steps,
                           batch_size=args.batch_size, lr=args.lr, temperature=args.temperature, alpha=args.alpha,
                           seed=args.seed)
    result = distill(recipe, args.out, compare=args.compare, progress=not args.no_progress)
    print(f"task {recipe.task}: student keeps layers {result.keep_layers}, saved to {result.path}")
    print(result.report)
    print("phases: " + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in result.seconds.items()))
    print(f"load it: LLM({str(result.path)!r}) or AutoModelForCausalLM.from_pretrained({str(result.path)!r}); "
          f"export it: minillm distill export {result.path} --type q8_0")
    if args.plot:
        result.loss_figure().write_html(args.plot)
        print(f"loss curve: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"recipe": dataclasses.asdict(recipe), "rows": result.rows, "seconds": result.seconds,
                       "histories": result.histories}, f, indent=1)
    return 0


def cmd_export(argv: list[str]) -> int:
    from ..distill.export_gguf import FILE_TYPES, export_gguf

    parser = argparse.ArgumentParser(prog="minillm distill export",
                                     description="a Hugging Face Llama directory to GGUF, with an Ollama Modelfile")
    parser.add_argument("model", help="an HF directory (a distilled student, or 'default' for SmolLM2-135M-Instruct)")
    parser.add_argument("--type", dest="file_type", choices=list(FILE_TYPES), default="q8_0")
    parser.add_argument("--out", default="exports", help="the folder for the .gguf and the Modelfile")
    parser.add_argument("--name", default=None, help="the file's stem (default: the directory's name)")
    args = parser.parse_args(argv)
    model = args.model
    if model == "default":
        from ..models.default import default_model_path

        model = default_model_path()
    try:
        path = export_gguf(model, args.out, args.file_type, args.name)
    except (ValueError, FileNotFoundError, NotImplementedError) as exc:
        print(f"minillm distill export: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB) and {path.parent / 'Modelfile'}")
    print(f"llama.cpp: llama-cli -m {path}; Ollama: cd {path.parent} && ollama create my-model -f Modelfile")
    return 0


def add_parser(sub) -> None:
    from ..distill.student import STRATEGIES
    from ..distill.tasks import TASKS

    d = sub.add_parser("distill", help="distil a smaller student from a teacher on a focused task and score it "
                                       "beside the teacher on held-out messages (export: minillm distill export)")
    d.add_argument("--task", choices=list(TASKS), default="extract",
                   help="extract: name / order id / product as JSON; intent: one of the support intents as JSON")
    d.add_argument("--teacher", default=None, help="an HF directory (default: SmolLM2-135M-Instruct)")
    d.add_argument("--adapter", default=None, help="a PEFT adapter directory merged into the teacher")
    d.add_argument("--layers", type=_in_range("--layers", 1, 1000), default=6, help="layers the student keeps")
    d.add_argument("--strategy", choices=list(STRATEGIES), default="spread", help="which layers it keeps")
    d.add_argument("--intermediate-size", type=_in_range("--intermediate-size", 1, 1 << 20), default=None,
                   help="narrower MLPs (default: the teacher's width)")
    d.add_argument("--train", type=_in_range("--train", 1, 5000), default=96, help="training messages")
    d.add_argument("--heldout", type=_in_range("--heldout", 1, 5000), default=48, help="held-out messages")
    d.add_argument("--steps", type=_in_range("--steps", 1, 100_000), default=60)
    d.add_argument("--batch-size", type=_in_range("--batch-size", 1, 5000), default=8)
    d.add_argument("--lr", type=_in_range("--lr", 1e-7, 1.0, float), default=1e-3)
    d.add_argument("--temperature", type=_in_range("--temperature", 0.05, 100.0, float), default=2.0)
    d.add_argument("--alpha", type=_in_range("--alpha", 0.0, 1.0, float), default=0.5,
                   help="weight of the KL to the teacher (1: KL only, 0: cross-entropy on its tokens only)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--out", default="students/student", help="the student's HF directory")
    d.add_argument("--compare", action="store_true",
                   help="also score the pruned student untrained and one trained on the task's true labels alone")
    d.add_argument("--plot", default=None, metavar="HTML", help="write the plotly loss curve here")
    d.add_argument("--json", default=None, help="also write the scores and loss histories to this file")
    d.add_argument("--no-progress", action="store_true")
    d.set_defaults(func=cmd_distill)

"""A progress bar for TRL's trainers (warm start and GRPO) that shows the latest loss or reward, instead of
transformers' default of printing every log dict (`PrinterCallback`) or writing it under the bar."""

from __future__ import annotations

from typing import Any

from transformers import PrinterCallback, ProgressCallback, Trainer

SHOWN = {"loss": "loss", "reward": "reward"}  # log key -> the bar's label


class StepProgress(ProgressCallback):
    """transformers' bar over the run's steps, labelled, with the latest SHOWN values as its postfix."""

    def __init__(self, label: str) -> None:
        super().__init__()
        self.label = label

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        super().on_train_begin(args, state, control, **kwargs)
        if self.training_bar is not None:
            self.training_bar.set_description(self.label)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
        if self.training_bar is None or not logs:
            return
        shown = {label: f"{logs[key]:.3g}" for key, label in SHOWN.items() if isinstance(logs.get(key), int | float)}
        if shown:
            self.training_bar.set_postfix(shown, refresh=False)


def show_progress(trainer: Trainer, label: str) -> None:
    """Replace the trainer's log printing with a labelled progress bar (stderr)."""
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(StepProgress(label))

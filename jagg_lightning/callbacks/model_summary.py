"""The model summary a fit prints at its start, without Lightning's FLOPs column: Lightning measures FLOPs only on an
``example_input_array``, which a GRPO module has none of, so the column and its total always read 0."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import get_formatted_model_size, get_human_readable_count


class ParameterSummary(RichModelSummary):
    """Lightning's rich model summary (name, type, parameters, mode) and its parameter counts, with no FLOPs.

    Args:
        max_depth: How deep the module tree is listed (Lightning's `ModelSummary.max_depth`).
    """

    def __init__(self, max_depth: int = 1):
        super().__init__(max_depth=max_depth)

    @staticmethod
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int = 0,
                  **summarize_kwargs: Any) -> None:
        from rich import get_console
        from rich.table import Table

        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for i, (name, _) in enumerate(columns):
            table.add_column(name or " ", style="dim" if i == 0 else None,
                             justify="right" if name in ("Params", "Params per Device", "In sizes", "Out sizes")
                             else "left")
        for row in zip(*(values for _, values in columns)):
            table.add_row(*row)
        console = get_console()
        console.print(table)
        counts = [("Trainable params", get_human_readable_count(int(trainable_parameters))),
                  ("Non-trainable params", get_human_readable_count(int(total_parameters - trainable_parameters))),
                  ("Total params", get_human_readable_count(int(total_parameters))),
                  ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
                  ("Modules in train mode", total_training_modes["train"]),
                  ("Modules in eval mode", total_training_modes["eval"])]
        for name, value in counts:
            console.print(f"[bold]{name}[/]: {value}")

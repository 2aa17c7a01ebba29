"""The notes a distributed cell leaves about what it could not bring back exactly (a DDP wrapper
that cannot be pickled, a tensor that came back without its autograd graph, CUDA tensors moved
to the CPU): information, not errors, so they are shown quietly (on stdout, not in the red
stderr box) and each once per kernel: the same note for the same name is not repeated on every
run of a cell, unless its reason changes. ``enot_nb.last_notes()`` lists the last cell's again.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Note:
    subject: str
    """What the note is about (a variable's name, or the kind of note): one shown per subject."""
    text: str


@dataclass
class Notes:
    """This kernel's notes: those already shown (by subject), and the last cell's."""

    shown: dict[str, str] = field(default_factory=dict)
    last: list[str] = field(default_factory=list)

    def start_cell(self) -> None:
        """A new cell: its notes, none so far, are the last."""
        self.last = []

    def once(self, note: Note) -> None:
        """Print one note outside a cell's own (what a push left in the notebook), unless shown
        before with the same text; it is among the last cell's notes."""
        self.last.append(note.text)
        if self.shown.get(note.subject) != note.text:
            self.shown[note.subject] = note.text
            print(f"enot_nb note: {note.text}", flush=True)

    def show(self, notes: list[Note]) -> None:
        """Print the notes not shown before with the same text; remember them all as the last."""
        self.last = [note.text for note in notes]
        for note in notes:
            if self.shown.get(note.subject) != note.text:
                self.shown[note.subject] = note.text
                print(f"enot_nb note: {note.text}", flush=True)


NOTES = Notes()


def last_notes() -> list[str]:
    """The notes of the last distributed cell of this kernel, shown or not.

    Returns:
        Each note's text (a note shown by an earlier cell is not printed again, but is listed).

    Example:
        ```python
        enot_nb.last_notes()  # ["'ddp' was not brought back: DistributedDataParallel cannot be pickled ..."]
        ```
    """
    return list(NOTES.last)

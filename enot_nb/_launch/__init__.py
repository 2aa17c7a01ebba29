"""Launch: the kernel's side of a launch.

The options, defined and checked once (``options``), the validated plan (``plan``), one attempt
from start to close (``attempt``), each rank's pipes and messages (``ranks``), forwarded output
(``output``) and what the shown ranks display, published under the cell (``relay``)."""

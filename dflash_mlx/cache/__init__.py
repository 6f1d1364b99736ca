"""Every cache the engine keeps: the target's K/V and recurrent state per row (``ragged.py``, with
exact rollback in ``rollback.py``), the drafter's context within its window (``context.py``), and
the prompt cache that lets a request start where an earlier one left off (``prompt.py``)."""

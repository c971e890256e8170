"""What goes wrong during a run, and how it is survived: non-finite values checked, skipped or stopped on
(``nonfinite.py``), stop signals and their safe point (``preemption.py``) and crash-safe writes that never leave
a half-written file or overwrite a finished run (``io.py``). Plain Python and torch; it may import only
``utils/``, and every part that writes or checks may import it.
"""

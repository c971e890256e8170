"""Training over several processes: the DDP and FSDP2 strategies (``strategies.py``: a new strategy goes there;
configs name them by the public path that the re-export ``strategies.py`` at the top keeps), the collectives of an
update -- one gradient all-reduce (``collectives.py``) --, context (sequence) parallelism (``context_parallel.py``),
loading a sharded checkpoint (``sharded_checkpoint.py``) and a dead peer's timeout (``peer_failure.py``). It may
import ``utils/``, ``faults/`` and ``models/`` (what a strategy shards, compiles or keeps in float32); only
``strategies.py`` imports Lightning.
"""

"""The leaves every folder may import, each importing nothing of ours: the compute-dtype rule (``dtypes.py``),
one message per bad value (``checks.py``), batch-first slicing (``batching.py``), shipped names and local paths
(``assets.py``), the DTensor gather / reshard helpers of FSDP2 (``sharding.py``) and the strict argparse parser of
``jagg plan`` and ``jagg serve-reward`` (``strict_args.py``). Nothing domain-specific goes here: a module that
knows about windows, steps, models or processes belongs to that folder.
"""

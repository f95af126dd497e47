"""Lightning's side of checkpoints: what ``pl_load`` returns for a sharded folder (``loaders.py``) and every patch
this package makes to Lightning, with when each is installed (``patches.py``, the one place).

May import the core checkpoint modules, ``_compat`` and Lightning; the core modules never import this sub-room.
"""

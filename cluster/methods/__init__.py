"""The built-in draft methods, one file each, registered in one table.

Adding a method: a `DraftMethod` subclass in a new file here and one line below
(`cluster/config/draft_registry.py` says what a method declares). Detection tries the methods
in this order, draft models last.
"""

from cluster.config.draft_registry import register_draft_method
from cluster.methods.draft_model import DraftModelMethod
from cluster.methods.eagle import Eagle
from cluster.methods.eagle3 import Eagle3
from cluster.methods.mtp import MTP
from cluster.methods.ngram import Ngram

BUILTIN_METHODS = (
    Eagle3(),
    MTP(),
    Eagle(),
    DraftModelMethod(),
    Ngram(),
)

for _method in BUILTIN_METHODS:
    register_draft_method(_method)

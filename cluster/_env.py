"""Process settings that must be made before torch's compiler is first imported.

torch fixes inductor's cache folder the first time `torch._inductor` is imported (the
package's own imports do that), so the folder under the cluster cache
(`$CLUSTER_CACHE_DIR/inductor`, default `~/.cache/cluster/inductor`) is set here, when
`cluster` is imported, unless `TORCHINDUCTOR_CACHE_DIR` already names one.
"""

import os

from cluster.models.default_model import cache_dir

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache_dir(), "inductor"))

"""portddp: PyTorch's DistributedDataParallel design, implemented on PyTorch and on JAX.

    import portddp
    world = portddp.init()          # under mpirun, torchrun, or alone
    from portddp.torch import DistributedDataParallel
"""

from portddp.buckets import Bucket, BucketPlan, ParamSpec, plan_buckets, rebuild_plan
from portddp.launch import World, init, world

__all__ = ["Bucket", "BucketPlan", "ParamSpec", "World", "init", "plan_buckets", "rebuild_plan", "world"]
__version__ = "0.1.0"

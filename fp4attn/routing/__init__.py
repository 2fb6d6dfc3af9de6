"""Which kernel runs a call, and with which launch: the routing of every op, as data.

Pure Python, no Triton import: `fp4attn.attention`, `fp4attn.decode` and
`fp4attn.explain` ask this package, the launchers read their launch tables from it, and
a reader finds here every decision a call goes through, a module for each:

    targets         the target, the GPU generation a call runs for: "sm_90" (Hopper),
                    "sm_100" (datacenter Blackwell), "sm_120", other "sm_XY", or "cpu";
                    FP4ATTN_TARGET overrides it (with TRITON_INTERPRET=1 that runs a
                    target's Triton kernels on CPU tensors under the interpreter); the
                    backend asked for (FP4ATTN_BACKEND)
    capability      what the installation builds: the one probe of the CUDA C++ kernels
                    (`cuda_kernels_unavailable`, which also checks their sources are
                    installed), Triton's presence
    families        the family, a set of kernels for one target and direction
                    (`KERNEL_FAMILIES`): the first whose target matches and which
                    accepts the recipe, head dim and mask runs the call, else the
                    reference (`route` -> `Route`, what `explain` returns)
    hopper, blackwell
                    what each architecture's families take, and what they run
                    (Blackwell's launch tables too)
    common          what every family shares: the key tile, the kernel head dims
    variants        the variant codes the kernels compile, as enums (`PMode`, ...)
    hopper_tables   the launch, the launch shape of the Hopper kernels
                    (`FORWARD_LAUNCH`, `BACKWARD_LAUNCH`), each entry with a one-line
                    reason and its measurements in the family's note (docs/notes/);
                    `override_launch` replaces one for the current thread
    hopper_forward, hopper_backward
                    the plan, on Hopper the kernel that runs the call and its variant,
                    decided once from the call's data (`hopper_forward_plan`,
                    `hopper_backward_plan`): `explain` reports it, the launchers
                    execute it and decide nothing
    decode          a KV cache append's and a decode call's route (`decode_route`)

Every public name of these modules but `decode`'s is importable from the package
(`fp4attn.routing.route`, `fp4attn.routing.FORWARD_LAUNCH`, ...). A test that stands in
for a device patches the probe where every route looks it up:
`capability.cuda_kernels_unavailable`, `targets.interpreting`.
"""

from fp4attn.routing import decode
from fp4attn.routing.blackwell import (
    BLACKWELL_BACKWARD_LAUNCH,
    BLACKWELL_FORWARD_LAUNCH,
    BLACKWELL_FORWARD_ROBUST_FIELDS,
    BLACKWELL_PV,
    BLACKWELL_TARGETS,
    BLACKWELL_TRAIN_ROBUST_FIELDS,
    CONSUMER_BLACKWELL_TARGETS,
    SERIAL_BLACKWELL_LAUNCH,
    SM120_FORWARD_LAUNCH,
    BlackwellLaunch,
    blackwell_backward_launch,
    blackwell_forward_launch,
    blackwell_forward_unsupported,
    blackwell_train_unsupported,
    override_blackwell_launch,
)
from fp4attn.routing.capability import (
    CUDA_SOURCE_DIR,
    CUDA_SOURCES,
    cuda_kernels_unavailable,
    missing_cuda_sources,
)
from fp4attn.routing.common import HOPPER_HEAD_DIMS, KEY_TILE, TRAIN_GRAD_FORMATS, kernel_head_dim
from fp4attn.routing.families import KERNEL_FAMILIES, KernelFamily, Route, route
from fp4attn.routing.hopper import (
    HOPPER_ROBUST_FIELDS,
    HOPPER_TRAIN_QK,
    HOPPER_TRAIN_ROBUST_FIELDS,
    hopper_backward_route_plan,
    hopper_forward_route_plan,
    hopper_forward_unsupported,
    hopper_robust_unsupported,
    hopper_train_unsupported,
)
from fp4attn.routing.hopper_backward import (
    GLUON_BACKWARD_QK,
    BackwardKernel,
    BackwardPlan,
    backward_gluon_kernels,
    hopper_backward_plan,
    use_cuda_backward,
)
from fp4attn.routing.hopper_forward import ForwardKernel, ForwardPlan, hopper_forward_plan, use_cuda_forward
from fp4attn.routing.hopper_tables import (
    BACKWARD_LAUNCH,
    FORWARD_LAUNCH,
    INTERPRETER_FORWARD_LAUNCH,
    BackwardLaunch,
    ForwardLaunch,
    backward_launch,
    forward_launch,
    override_launch,
    table_backward_launch,
    table_forward_launch,
)
from fp4attn.routing.targets import (
    BACKEND_ENV,
    BACKENDS,
    INTERPRET_ENV,
    TARGET_ENV,
    TARGETS,
    interpreting,
    requested_backend,
    target_of,
)
from fp4attn.routing.variants import (
    GLUON_P_MODES,
    P_MODE_AFFINE_LAZY,
    P_MODE_AFFINE_TRAINED,
    P_MODE_DIRECTP_SINK,
    P_MODES,
    TRAIN_P_MODES,
    DkdvStaged,
    PMode,
    Variant,
    WSOverlap,
    p_mode,
    p_sink_tiles,
    trained_affine,
)

__all__ = [
    "BACKEND_ENV", "BACKENDS", "BACKWARD_LAUNCH", "BLACKWELL_BACKWARD_LAUNCH", "BLACKWELL_FORWARD_LAUNCH",
    "BLACKWELL_FORWARD_ROBUST_FIELDS", "BLACKWELL_PV", "BLACKWELL_TARGETS", "BLACKWELL_TRAIN_ROBUST_FIELDS",
    "CONSUMER_BLACKWELL_TARGETS", "CUDA_SOURCE_DIR", "CUDA_SOURCES", "FORWARD_LAUNCH", "GLUON_BACKWARD_QK",
    "GLUON_P_MODES", "HOPPER_HEAD_DIMS", "HOPPER_ROBUST_FIELDS", "HOPPER_TRAIN_QK", "HOPPER_TRAIN_ROBUST_FIELDS",
    "INTERPRETER_FORWARD_LAUNCH", "INTERPRET_ENV", "KERNEL_FAMILIES", "KEY_TILE", "P_MODES", "P_MODE_AFFINE_LAZY",
    "P_MODE_AFFINE_TRAINED", "P_MODE_DIRECTP_SINK", "SERIAL_BLACKWELL_LAUNCH", "SM120_FORWARD_LAUNCH", "TARGETS",
    "TARGET_ENV", "TRAIN_GRAD_FORMATS", "TRAIN_P_MODES", "BackwardKernel", "BackwardLaunch", "BackwardPlan",
    "BlackwellLaunch", "DkdvStaged", "ForwardKernel", "ForwardLaunch", "ForwardPlan", "KernelFamily", "PMode",
    "Route", "Variant", "WSOverlap", "backward_gluon_kernels", "backward_launch", "blackwell_backward_launch",
    "blackwell_forward_launch", "blackwell_forward_unsupported", "blackwell_train_unsupported",
    "cuda_kernels_unavailable", "decode", "forward_launch", "hopper_backward_plan", "hopper_backward_route_plan",
    "hopper_forward_plan", "hopper_forward_route_plan", "hopper_forward_unsupported", "hopper_robust_unsupported",
    "hopper_train_unsupported", "interpreting", "kernel_head_dim", "missing_cuda_sources", "override_blackwell_launch",
    "override_launch", "p_mode", "p_sink_tiles", "requested_backend", "route", "table_backward_launch",
    "table_forward_launch", "target_of", "trained_affine", "use_cuda_backward", "use_cuda_forward",
]

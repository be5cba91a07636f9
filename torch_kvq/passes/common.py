"""Former home of the pass helpers, kept so that old imports keep working.

Issue 16 split it: the stamp is in ``passes.stamp``, ``PassContext`` / ``KVQPass`` in
``passes.base``, graph reading in ``passes.graph_utils``, FP8 quant matching in
``passes.quant_match``. Import from those.
"""

from torch_kvq.passes.base import KVQPass, PassContext
from torch_kvq.passes.graph_utils import (
    ATTENTION,
    ATTENTION_FP8,
    AUTO_FUNCTIONALIZED,
    CACHE_WRITE,
    DEQUANTIZE,
    FLOAT_DTYPES,
    KVQ,
    QUANT_CACHE_WRITE,
    QUANT_CACHE_WRITE_TS,
    QUANTIZE,
    VIEW_OPS,
    count_ops,
    erase_dead,
    float_cast_arg,
    functional_op,
    has_output_scale,
    is_call,
    is_fp8_quant_end,
    kvq_nodes,
    layer_name_of,
    node_dtype,
    op_args,
    op_label,
    single_user_chain,
    skip_float_casts,
)
from torch_kvq.passes.quant_match import (
    StaticQuant,
    match_static_fp8_quant,
    quant_mismatch,
    scale_tensor,
)
from torch_kvq.passes.stamp import META_KEY, KVQStamp, get_stamp, short_dtype

__all__ = [
    "ATTENTION",
    "ATTENTION_FP8",
    "AUTO_FUNCTIONALIZED",
    "CACHE_WRITE",
    "DEQUANTIZE",
    "FLOAT_DTYPES",
    "KVQ",
    "META_KEY",
    "QUANTIZE",
    "QUANT_CACHE_WRITE",
    "QUANT_CACHE_WRITE_TS",
    "VIEW_OPS",
    "KVQPass",
    "KVQStamp",
    "PassContext",
    "StaticQuant",
    "count_ops",
    "erase_dead",
    "float_cast_arg",
    "functional_op",
    "get_stamp",
    "has_output_scale",
    "is_call",
    "is_fp8_quant_end",
    "kvq_nodes",
    "layer_name_of",
    "match_static_fp8_quant",
    "node_dtype",
    "op_args",
    "op_label",
    "quant_mismatch",
    "scale_tensor",
    "short_dtype",
    "single_user_chain",
    "skip_float_casts",
]

"""One view of an op for the sharding rules, whichever front end produced the node.

symbolic_trace graphs call torch functions, operator.* and tensor methods; export graphs
call aten overloads. `op_of(node)` names the op by a canonical kind and returns its
arguments by name, so each sharding rule is written once:

    F.linear(x, w, b)  /  aten.linear.default(x, w, b)   ->  OpInfo("linear", {input, weight, bias})
    x.view(2, 4, 8)    /  aten.view.default(x, [2, 4, 8]) ->  OpInfo("view", {input, shape})
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.operator_schemas import normalize_function

from graphpar.runtime import ops

aten = torch.ops.aten


@dataclass
class OpInfo:
    kind: str
    args: Dict[str, Any] = field(default_factory=dict)


# Pointwise ops: the output has the broadcast shape of the tensor inputs, element by element.
POINTWISE_ATEN = {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.neg.default,
    aten.gelu.default, aten.silu.default, aten.relu.default, aten.tanh.default, aten.sigmoid.default,
    aten.pow.Tensor_Scalar, aten.rsqrt.default, aten.exp.default, aten.add.Scalar, aten.mul.Scalar,
    aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.clone.default, aten.contiguous.default,
    aten.alias.default, aten.type_as.default, aten.sqrt.default, aten.where.self, aten.masked_fill.Scalar,
    aten.erf.default, aten.abs.default, aten.sub.Scalar, aten.div.Scalar, aten.gelu_.default,
    aten.relu_.default, aten.silu_.default, aten.add_.Tensor, aten.mul_.Tensor, aten.dropout.default,
}
POINTWISE_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, torch.add, torch.sub,
    torch.mul, torch.div, torch.neg, torch.tanh, torch.sigmoid, torch.exp, torch.rsqrt, torch.sqrt,
    torch.pow, torch.where, torch.erf, F.gelu, F.silu, F.relu, torch.relu, F.tanh, F.sigmoid,
    ops.dropout, torch.nn.functional.dropout,
}
POINTWISE_METHODS = {
    "add", "sub", "mul", "div", "neg", "pow", "tanh", "sigmoid", "exp", "rsqrt", "sqrt", "float",
    "half", "bfloat16", "to", "type_as", "contiguous", "clone", "relu", "masked_fill", "__add__",
    "__mul__", "__sub__", "__truediv__",
}
# View-like ops: the output is the input's elements in a new shape; rules map dims by shape.
RESHAPE = {aten.view.default: "view", aten.reshape.default: "view", aten._unsafe_view.default: "view",
           aten.flatten.using_ints: "view", aten.unsqueeze.default: "view", aten.squeeze.dim: "view",
           aten.expand.default: "expand", torch.broadcast_to: "expand", torch.flatten: "view", torch.reshape: "view",
           torch.unsqueeze: "view", torch.squeeze: "view"}
RESHAPE_METHODS = {"view": "view", "reshape": "view", "flatten": "view", "unsqueeze": "view",
                   "squeeze": "view", "expand": "expand", "broadcast_to": "expand",
                   "unflatten": "view"}


def _normalized(node: torch.fx.Node) -> Optional[Dict[str, Any]]:
    try:
        result = normalize_function(node.target, tuple(node.args), dict(node.kwargs),
                                    normalize_to_only_use_kwargs=True)
    except Exception:  # noqa: BLE001 - an op whose schema torch cannot match is simply unknown
        return None
    return dict(result.kwargs) if result is not None else None


def _method(node: torch.fx.Node) -> OpInfo:
    name = node.target
    args = list(node.args)
    if name in POINTWISE_METHODS:
        return OpInfo("pointwise", {"inputs": args})
    if name in RESHAPE_METHODS:
        return OpInfo(RESHAPE_METHODS[name], {"input": args[0], "shape": args[1:]})
    if name == "transpose":
        return OpInfo("transpose", {"input": args[0], "dim0": args[1], "dim1": args[2]})
    if name == "permute":
        dims = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        return OpInfo("permute", {"input": args[0], "dims": list(dims)})
    if name in ("split", "chunk"):
        return OpInfo(name, {"input": args[0], "size": args[1],
                             "dim": node.kwargs.get("dim", args[2] if len(args) > 2 else 0)})
    if name == "repeat_interleave":
        return OpInfo("repeat_interleave", {"input": args[0], "dim": node.kwargs.get("dim", args[2] if len(args) > 2 else None)})
    if name == "select":
        return OpInfo("select", {"input": args[0], "dim": node.kwargs.get("dim", args[1] if len(args) > 1 else None)})
    if name == "baddbmm":
        return OpInfo("baddbmm", {"input": args[0], **dict(zip(("batch1", "batch2"), args[1:])), **node.kwargs})
    if name == "size":
        return OpInfo("size", {"input": args[0]})
    if name in ("mean", "sum"):
        return OpInfo("reduce", {"input": args[0], "dim": node.kwargs.get("dim", args[1] if len(args) > 1 else None),
                                 "keepdim": node.kwargs.get("keepdim", args[2] if len(args) > 2 else False)})
    if name == "softmax":
        return OpInfo("softmax", {"input": args[0], "dim": node.kwargs.get("dim", args[1] if len(args) > 1 else None)})
    return OpInfo("unknown")


_FUNCTION_KINDS = {
    F.linear: "linear", aten.linear.default: "linear",
    aten.addmm.default: "addmm", torch.addmm: "addmm",
    F.embedding: "embedding", aten.embedding.default: "embedding",
    F.layer_norm: "norm", aten.layer_norm.default: "norm", F.rms_norm: "norm", aten.rms_norm.default: "norm",
    F.scaled_dot_product_attention: "sdpa", aten.scaled_dot_product_attention.default: "sdpa",
    ops.attention: "sdpa",
    F.cross_entropy: "cross_entropy", aten.cross_entropy_loss.default: "cross_entropy",
    aten.transpose.int: "transpose", torch.transpose: "transpose",
    aten.permute.default: "permute", torch.permute: "permute",
    aten.split.Tensor: "split", aten.split_with_sizes.default: "split", torch.split: "split",
    aten.chunk.default: "chunk", torch.chunk: "chunk",
    aten.slice.Tensor: "slice", aten.select.int: "select", torch.select: "select",
    aten.baddbmm.default: "baddbmm", torch.baddbmm: "baddbmm",
    aten.cat.default: "cat", torch.cat: "cat", aten.stack.default: "stack", torch.stack: "stack",
    aten.softmax.int: "softmax", aten._softmax.default: "softmax", F.softmax: "softmax", torch.softmax: "softmax",
    aten.repeat_interleave.self_int: "repeat_interleave", torch.repeat_interleave: "repeat_interleave",
    aten.matmul.default: "matmul", torch.matmul: "matmul", operator.matmul: "matmul",
    aten.bmm.default: "matmul", torch.bmm: "matmul",
    operator.getitem: "getitem",
    aten.mean.dim: "reduce", aten.sum.dim_IntList: "reduce",
    aten._assert_tensor_metadata.default: "assert_metadata",
}


def op_of(node: torch.fx.Node) -> OpInfo:
    if node.op == "call_method":
        return _method(node)
    if node.op != "call_function":
        return OpInfo(node.op)
    target = node.target
    if target in POINTWISE_ATEN or target in POINTWISE_FUNCTIONS:
        return OpInfo("pointwise", {"inputs": list(node.args) + list(node.kwargs.values())})
    if target in RESHAPE:
        return OpInfo(RESHAPE[target], {"input": node.args[0]})
    if target is getattr and node.args[1] == "shape":   # `x.shape` as symbolic_trace records it
        return OpInfo("size", {"input": node.args[0]})
    kind = _FUNCTION_KINDS.get(target)
    if kind is None:
        return OpInfo("unknown")
    if kind == "getitem":
        return OpInfo("getitem", {"input": node.args[0], "index": node.args[1]})
    if target is operator.matmul:  # `a @ b`: torch has no schema for the operator to normalise by
        return OpInfo("matmul", {"input": node.args[0], "other": node.args[1]})
    args = _normalized(node)
    if args is None:
        return OpInfo("unknown")
    return OpInfo(kind, args)

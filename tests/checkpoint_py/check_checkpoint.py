"""Opens a stepfuse checkpoint with the safetensors package and compares it with what
the optimizer held when it was saved (safetensors_test writes both files).

Usage: check_checkpoint.py CHECKPOINT EXPECTED_JSON

EXPECTED_JSON: {"tensors": {name: {"shape": [n], "bits": [u32, ...]}},
                "metadata": {key: string value},
                "json_metadata": {key: the value's JSON, decoded}}
The checkpoint must hold exactly those tensors, as float32 of that shape and those bit
patterns, and those metadata entries (plus "checksum"); every metadata value is a string.
Prints "ok" and exits 0, or prints each difference and exits 1.
"""
import json
import sys

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file


def main(path, expected_path):
    with open(expected_path, encoding="utf-8") as f:
        expected = json.load(f)
    problems = []

    tensors = load_file(path)
    if set(tensors) != set(expected["tensors"]):
        problems.append(f"tensor names: {sorted(tensors)} != {sorted(expected['tensors'])}")
    for name, want in expected["tensors"].items():
        got = tensors.get(name)
        if got is None:
            continue
        if got.dtype != np.float32 or list(got.shape) != want["shape"]:
            problems.append(f"{name}: {got.dtype} {list(got.shape)}, expected float32 {want['shape']}")
            continue
        if got.view(np.uint32).tolist() != want["bits"]:
            problems.append(f"{name}: values differ from Optimizer::state()")

    with safe_open(path, framework="np") as f:
        meta = f.metadata() or {}
        if sorted(f.keys()) != sorted(expected["tensors"]):
            problems.append("safe_open lists other tensors than load_file")
    wanted_keys = set(expected["metadata"]) | set(expected["json_metadata"]) | {"checksum"}
    if set(meta) != wanted_keys:
        problems.append(f"metadata keys: {sorted(meta)} != {sorted(wanted_keys)}")
    for key, value in meta.items():
        if not isinstance(value, str):
            problems.append(f"metadata {key} is not a string")
    for key, value in expected["metadata"].items():
        if meta.get(key) != value:
            problems.append(f"metadata {key}: {meta.get(key)!r} != {value!r}")
    for key, value in expected["json_metadata"].items():
        try:
            got = json.loads(meta.get(key, "null"))
        except ValueError as e:
            problems.append(f"metadata {key} is not JSON: {e}")
            continue
        if got != value:
            problems.append(f"metadata {key}: {got!r} != {value!r}")

    for p in problems:
        print(p)
    if problems:
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))

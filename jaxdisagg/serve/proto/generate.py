"""Regenerates jaxdisagg_pb2.py and jaxdisagg_pb2_grpc.py from jaxdisagg.proto.

    python -m jaxdisagg.serve.proto.generate [OUT_DIR]

grpcio-tools is a development dependency only; the generated modules are committed.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGE = "jaxdisagg.serve.proto"


def generate(out_dir: Path) -> list[Path]:
    import grpc_tools
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).parent / "_proto"
    code = protoc.main(["protoc", f"-I{HERE}", f"-I{include}", f"--python_out={out_dir}",
                        f"--grpc_python_out={out_dir}", str(HERE / "jaxdisagg.proto")])
    if code != 0:
        raise RuntimeError(f"protoc failed ({code})")
    grpc_module = out_dir / "jaxdisagg_pb2_grpc.py"
    # protoc writes a top-level import; the package needs its own path.
    grpc_module.write_text(grpc_module.read_text().replace(
        "import jaxdisagg_pb2 as jaxdisagg__pb2", f"from {PACKAGE} import jaxdisagg_pb2 as "
        "jaxdisagg__pb2"))
    return [out_dir / "jaxdisagg_pb2.py", grpc_module]


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(f"wrote {path}")

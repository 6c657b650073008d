"""Regenerate the Python code for the protos (docs/ARCHITECTURE.md, convention 6).

    python -m specpool.services.protogen            # rewrite specpool/v1/ from protos/
    python -m specpool.services.protogen --check    # exit 1, naming the stale files, if specpool/v1/ is out of date

protoc (the one bundled with grpcio-tools) compiles every ``protos/**/*.proto`` into
``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` in ``specpool/v1/``. The proto package is
``specpool.v1``, so protoc's own imports (``from specpool.v1 import common_pb2``) and the module
names it gives the descriptors are already the installed package's: nothing is rewritten. The output depends only on the .proto files and the grpcio-tools version: no timestamps,
no absolute paths, files in sorted order. Pin grpcio-tools to reproduce the committed code byte
for byte; another version embeds other version numbers and the check reports the files as stale.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"  # holds specpool/v1/*.proto
GEN_PACKAGE = "specpool.v1"  # the proto package, and so the Python package of the generated code
GEN_ROOT = REPO_ROOT / "specpool" / "v1"  # generated code; every file in it belongs to this tool

_GEN_INIT = (
    '"""Generated protobuf and gRPC code. Do not edit: change protos/ and run '
    '`python -m specpool.services.protogen`."""\n'
)


class ProtogenError(RuntimeError):
    """protoc is missing or failed; the message says what to do."""


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Every .proto file under ``proto_root``, in a stable order."""
    return sorted(proto_root.rglob("*.proto"), key=lambda p: p.relative_to(proto_root).as_posix())


def generator_version() -> str:
    """The grpcio-tools version, whose bundled protoc decides the generated text."""
    try:
        return importlib.metadata.version("grpcio-tools")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _run_protoc(proto_root: Path, out_dir: Path | None, extra: list[str] | None = None) -> None:
    try:
        from grpc_tools import protoc
    except ImportError as exc:  # grpcio-tools is in the `test` extra
        raise ProtogenError("protogen needs grpcio-tools (in the test extra): pip install -e '.[test]'") from exc
    import grpc_tools

    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"  # google/protobuf/*.proto
    files = proto_files(proto_root)
    if not files:
        raise ProtogenError(f"no .proto files under {proto_root}")
    args = [
        "grpc_tools.protoc",
        f"--proto_path={proto_root}",
        f"--proto_path={well_known}",
        *([f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}"] if out_dir else []),
        *(extra or []),
        *(str(f) for f in files),
    ]
    if protoc.main(args) != 0:
        raise ProtogenError("protoc failed (its message is above)")


def descriptor_set(proto_root: Path = PROTO_ROOT) -> bytes:
    """A serialised ``FileDescriptorSet`` of the protos with their comments (source info), for
    checks that every element is documented."""
    with tempfile.TemporaryDirectory(prefix="specpool-protogen-") as tmp:
        out = Path(tmp) / "descriptors.pb"
        _run_protoc(proto_root, None, ["--include_source_info", f"--descriptor_set_out={out}"])
        return out.read_bytes()


def render(proto_root: Path = PROTO_ROOT) -> dict[str, bytes]:
    """The generated package as {path relative to GEN_ROOT (posix): content}, ``__init__.py`` included."""
    prefix = GEN_PACKAGE.replace(".", "/") + "/"
    files: dict[str, bytes] = {"__init__.py": _GEN_INIT.encode()}
    with tempfile.TemporaryDirectory(prefix="specpool-protogen-") as tmp:
        out_dir = Path(tmp)
        _run_protoc(proto_root, out_dir)
        for path in sorted(out_dir.rglob("*")):
            if not path.is_file():
                continue
            rel = path.relative_to(out_dir).as_posix()
            if not rel.startswith(prefix):
                raise ProtogenError(f"{rel}: every proto must be in package {GEN_PACKAGE} (protos/{prefix})")
            files[rel[len(prefix):]] = path.read_bytes()
    return dict(sorted(files.items()))


def _existing(gen_root: Path) -> dict[str, bytes]:
    if not gen_root.is_dir():
        return {}
    return {
        p.relative_to(gen_root).as_posix(): p.read_bytes()
        for p in sorted(gen_root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


def stale_files(gen_root: Path = GEN_ROOT, proto_root: Path = PROTO_ROOT) -> list[str]:
    """Paths (relative to the repo when possible) that differ from what the protos generate:
    changed, missing, or left over from a proto that no longer exists. Empty: up to date."""
    wanted = render(proto_root)
    have = _existing(gen_root)
    stale = sorted(
        {rel for rel in wanted if have.get(rel) != wanted[rel]}
        | {rel for rel in have if rel not in wanted}
    )
    return [_display(gen_root / rel) for rel in stale]


def write(gen_root: Path = GEN_ROOT, proto_root: Path = PROTO_ROOT) -> list[str]:
    """Regenerate ``gen_root``; returns one line per file written or removed."""
    wanted = render(proto_root)
    have = _existing(gen_root)
    changed = []
    for rel, content in wanted.items():
        if have.get(rel) != content:
            target = gen_root / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
            changed.append(f"wrote {_display(target)}")
    for rel in have:
        if rel not in wanted:
            (gen_root / rel).unlink()
            changed.append(f"removed {_display(gen_root / rel)}")
    return changed


def _display(path: Path) -> str:
    try:
        return path.relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specpool.services.protogen", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the generated code is stale")
    args = parser.parse_args(argv)
    try:
        return _check() if args.check else _write()
    except ProtogenError as exc:
        print(f"protogen: error: {exc}", file=sys.stderr)
        return 2


def _check() -> int:
    stale = stale_files(GEN_ROOT, PROTO_ROOT)
    if not stale:
        print(f"{_display(GEN_ROOT)} is up to date with {_display(PROTO_ROOT)}")
        return 0
    print(
        f"stale generated code: protos/ generates something else (with grpcio-tools "
        f"{generator_version()}); run `python -m specpool.services.protogen`:",
        file=sys.stderr,
    )
    for path in stale:
        print(f"  {path}", file=sys.stderr)
    return 1


def _write() -> int:
    changed = write(GEN_ROOT, PROTO_ROOT)
    for line in changed:
        print(line)
    print(f"{_display(GEN_ROOT)}: {len(changed)} file(s) changed (grpcio-tools {generator_version()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

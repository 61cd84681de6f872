"""MkDocs hook: the contracts' reference, one page per proto file under protos/pipelinerl, rendered
at build time from the comments of its services, methods, messages, fields and enums.

protoc (grpcio-tools) parses the files with their source info, so comments are read the way
protoc attaches them, not by parsing proto text here."""

from __future__ import annotations

import tempfile
from importlib import resources
from pathlib import Path

from google.protobuf import descriptor_pb2 as d
from grpc_tools import protoc
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2] / "protos"
PAGES = "reference/contracts"
# Field numbers of FileDescriptorProto and its children: the paths of SourceCodeInfo.Location.
PACKAGE, MESSAGES, ENUMS, SERVICES = 2, 4, 5, 6
FIELDS, NESTED_MESSAGES, NESTED_ENUMS, ENUM_VALUES, METHODS = 2, 3, 4, 2, 2
SCALARS = {
    value: name.removeprefix("TYPE_").lower()
    for name, value in d.FieldDescriptorProto.Type.items()
    if name not in ("TYPE_MESSAGE", "TYPE_ENUM", "TYPE_GROUP")
}

Path_ = tuple[int, ...]


def page_of(proto: str) -> str:
    """`pipelinerl/reward/v1/reward.proto` → `reference/contracts/reward.md`."""
    return f"{PAGES}/{Path(proto).stem}.md"


def compile_protos() -> d.FileDescriptorSet:
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "pipelinerl").rglob("*.proto"))
    include = resources.files("grpc_tools") / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        args = ["protoc", f"-I{ROOT}", f"-I{include}", "--include_source_info", f"--descriptor_set_out={out}"]
        if protoc.main([*args, *files]) != 0:
            raise RuntimeError(f"protoc could not parse {files}")
        return d.FileDescriptorSet.FromString(out.read_bytes())


class Renderer:
    """Renders one file; `types` maps every full type name of the set to its page and anchor."""

    def __init__(self, proto: d.FileDescriptorProto, types: dict[str, str]) -> None:
        self.proto = proto
        self.types = types
        self.comments = {
            tuple(loc.path): (loc.leading_comments or loc.trailing_comments).strip()
            for loc in proto.source_code_info.location
        }
        self.lines: list[str] = []

    def comment(self, path: Path_) -> str:
        return "\n".join(line.removeprefix(" ") for line in self.comments.get(path, "").splitlines())

    def cell(self, path: Path_) -> str:
        return self.comment(path).replace("|", "\\|").replace("\n", "<br>")

    def link(self, type_name: str) -> str:
        name = type_name.lstrip(".")
        target = self.types.get(name)
        short = name.rsplit(".", 1)[-1] if name.startswith(self.proto.package) else name
        if target is None:
            return f"`{short}`"
        page, anchor = target.split("#")
        here = page_of(self.proto.name)
        return f"[`{short}`]({'' if page == here else Path(page).name}#{anchor})"

    def type_of(self, field: d.FieldDescriptorProto, nested: dict[str, d.DescriptorProto]) -> str:
        entry = nested.get(field.type_name.lstrip("."))
        if entry is not None and entry.options.map_entry:
            key, value = entry.field
            return f"map<{self.type_of(key, nested)}, {self.type_of(value, nested)}>"
        kind = SCALARS.get(field.type) or self.link(field.type_name)
        if field.label == d.FieldDescriptorProto.LABEL_REPEATED:
            return f"repeated {kind}"
        return f"optional {kind}" if field.proto3_optional else kind

    def render(self) -> str:
        package = self.proto.package
        self.lines += [f"# {package}", "", f"`{self.proto.name}`", "", self.comment((PACKAGE,)), ""]
        for i, service in enumerate(self.proto.service):
            self.service(service, (SERVICES, i))
        for i, message in enumerate(self.proto.message_type):
            self.message(message, (MESSAGES, i), package)
        for i, enum in enumerate(self.proto.enum_type):
            self.enum(enum, (ENUMS, i), package)
        return "\n".join(self.lines) + "\n"

    def heading(self, kind: str, full_name: str) -> None:
        short = full_name.removeprefix(f"{self.proto.package}.")
        self.lines += [f"## {kind} {short} {{#{full_name}}}", ""]

    def service(self, service: d.ServiceDescriptorProto, path: Path_) -> None:
        full_name = f"{self.proto.package}.{service.name}"
        self.heading("service", full_name)
        self.lines += [self.comment(path), ""]
        for i, method in enumerate(service.method):
            request = ("stream " if method.client_streaming else "") + self.link(method.input_type)
            response = ("stream " if method.server_streaming else "") + self.link(method.output_type)
            self.lines += [
                f"### {method.name} {{#{full_name}.{method.name}}}",
                "",
                f"{request} → {response}",
                "",
                self.comment((*path, METHODS, i)),
                "",
            ]

    def message(self, message: d.DescriptorProto, path: Path_, scope: str) -> None:
        if message.options.map_entry:
            return
        full_name = f"{scope}.{message.name}"
        nested = {f"{full_name}.{m.name}": m for m in message.nested_type}
        self.heading("message", full_name)
        self.lines += [self.comment(path), ""]
        if message.field:
            self.lines += ["| field | type | # | |", "|---|---|---|---|"]
            for i, field in enumerate(message.field):
                oneof = ""
                if field.HasField("oneof_index") and not field.proto3_optional:
                    oneof = f" (oneof `{message.oneof_decl[field.oneof_index].name}`)"
                kind = self.type_of(field, nested)
                comment = self.cell((*path, FIELDS, i))
                self.lines.append(f"| `{field.name}` | {kind}{oneof} | {field.number} | {comment} |")
            self.lines.append("")
        for i, child in enumerate(message.nested_type):
            self.message(child, (*path, NESTED_MESSAGES, i), full_name)
        for i, enum in enumerate(message.enum_type):
            self.enum(enum, (*path, NESTED_ENUMS, i), full_name)

    def enum(self, enum: d.EnumDescriptorProto, path: Path_, scope: str) -> None:
        self.heading("enum", f"{scope}.{enum.name}")
        self.lines += [self.comment(path), "", "| value | # | |", "|---|---|---|"]
        for i, value in enumerate(enum.value):
            self.lines.append(f"| `{value.name}` | {value.number} | {self.cell((*path, ENUM_VALUES, i))} |")
        self.lines.append("")


def type_pages(protos: list[d.FileDescriptorProto]) -> dict[str, str]:
    """Every message and enum of these files: full name → `page#anchor`."""
    types: dict[str, str] = {}

    def add(scope: str, messages: list[d.DescriptorProto], enums: list[d.EnumDescriptorProto], page: str):
        for enum in enums:
            types[f"{scope}.{enum.name}"] = f"{page}#{scope}.{enum.name}"
        for message in messages:
            name = f"{scope}.{message.name}"
            types[name] = f"{page}#{name}"
            add(name, list(message.nested_type), list(message.enum_type), page)

    for proto in protos:
        add(proto.package, list(proto.message_type), list(proto.enum_type), page_of(proto.name))
    return types


def on_files(files: Files, config: MkDocsConfig) -> Files:
    protos = [p for p in compile_protos().file if p.name.startswith("pipelinerl/")]
    types = type_pages(protos)
    for proto in protos:
        files.append(File.generated(config, page_of(proto.name), content=Renderer(proto, types).render()))
    return files

"""Render a kustomization of deploy/ into plain YAML, without kubectl or kustomize.

    python deploy/render.py deploy/overlays/gpu OUTDIR [--file cluster.key=PATH]
    python deploy/render.py deploy/overlays/cpu - | kubectl apply -f -

The folders under deploy/ stay valid kustomize (`kubectl apply -k deploy/overlays/gpu` does
the same); this script implements only the kustomization fields they use, and refuses any
other with an error rather than ignoring it:

    resources          files (multi-document YAML) and directories (other kustomizations)
    namespace          set on every namespaced object; a Namespace object takes it as its name
    images             name -> newName / newTag / digest, in containers and initContainers
    replicas           name -> count (Deployments, StatefulSets)
    patches            {path: FILE} or {patch: YAML}: strategic merge patches, each naming its
                       target by kind and metadata.name (kustomize's default for those)
    configMapGenerator / secretGenerator
                       `files` (KEY=PATH or PATH) and `literals`, `options.labels`; names are
                       never hashed (generatorOptions.disableNameSuffixHash must be true)

Strategic merge, as far as deploy/'s patches need it: maps merge key by key, a null value
deletes the key, lists of maps that all carry `name` merge item by item by that name (Kubernetes'
merge key for containers, env and volumes), every other list is replaced whole.
Writes one file per object, NN-kind-name.yaml, in the order kubectl should apply them
(namespace and config first, workloads after), or one stream to stdout with OUTDIR `-`.
"""

from __future__ import annotations

import argparse
import base64
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

Object = dict[str, Any]

SUPPORTED_FIELDS = {"apiVersion", "kind", "resources", "namespace", "images", "replicas",
                    "patches", "configMapGenerator", "secretGenerator", "generatorOptions"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume",
                  "StorageClass", "CustomResourceDefinition", "PriorityClass"}
APPLY_ORDER = ["Namespace", "ServiceAccount", "Role", "ClusterRole", "RoleBinding",
               "ClusterRoleBinding", "ConfigMap", "Secret", "NetworkPolicy", "Service",
               "StatefulSet", "Deployment", "ScaledObject"]


class RenderError(ValueError):
    """A kustomization this renderer cannot render (or that kustomize would refuse too)."""


def render(directory: Path, file_overrides: dict[str, Path] | None = None) -> list[Object]:
    """The objects the kustomization in `directory` produces. `file_overrides` maps a
    generator's file name (e.g. cluster.key) to the file to read instead."""
    overrides = file_overrides or {}
    path = directory / "kustomization.yaml"
    if not path.is_file():
        raise RenderError(f"{directory} has no kustomization.yaml")
    spec = yaml.safe_load(path.read_text()) or {}
    unknown = set(spec) - SUPPORTED_FIELDS
    if unknown:
        raise RenderError(f"{path}: fields this renderer does not implement: {sorted(unknown)} "
                          "(use kubectl kustomize, or extend deploy/render.py)")
    objects: list[Object] = []
    for entry in spec.get("resources", []):
        target = directory / entry
        objects += render(target, overrides) if target.is_dir() else _load_documents(target)
    no_hash = spec.get("generatorOptions", {}).get("disableNameSuffixHash", False)
    for kind, key in (("ConfigMap", "configMapGenerator"), ("Secret", "secretGenerator")):
        for generator in spec.get(key, []):
            objects.append(_generate(kind, generator, directory, no_hash, overrides))
    for patch in spec.get("patches", []):
        for document in _patch_documents(patch, directory):
            _apply_patch(objects, document, path)
    for replica in spec.get("replicas", []):
        _set_replicas(objects, replica["name"], int(replica["count"]), path)
    for image in spec.get("images", []):
        _set_image(objects, image)
    if "namespace" in spec:
        for obj in objects:
            if obj["kind"] == "Namespace":
                obj["metadata"]["name"] = spec["namespace"]
            elif obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = spec["namespace"]
    _check_unique(objects, path)
    return objects


def _load_documents(path: Path) -> list[Object]:
    if not path.is_file():
        raise RenderError(f"no such resource file: {path}")
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for document in documents:
        if not isinstance(document, dict) or not {"apiVersion", "kind", "metadata"} <= set(
                document):
            raise RenderError(f"{path}: every document needs apiVersion, kind and metadata")
    return documents


def _generate(kind: str, generator: Object, directory: Path, no_hash: bool,
              overrides: dict[str, Path]) -> Object:
    name = generator["name"]
    if not (no_hash or generator.get("options", {}).get("disableNameSuffixHash", False)):
        raise RenderError(f"generator {name}: name hashes are not implemented; set "
                          "generatorOptions.disableNameSuffixHash: true")
    data: dict[str, str] = {}
    for entry in generator.get("files", []):
        key, _, source = entry.rpartition("=") if "=" in entry else ("", "", entry)
        key = key or Path(source).name
        path = overrides.get(key, directory / source)
        if not Path(path).is_file():
            raise RenderError(f"generator {name}: no file {path} (for key {key})")
        data[key] = Path(path).read_text()
    for literal in generator.get("literals", []):
        key, _, value = literal.partition("=")
        data[key] = value
    obj: Object = {"apiVersion": "v1", "kind": kind, "metadata": {"name": name}}
    labels = generator.get("options", {}).get("labels")
    if labels:
        obj["metadata"]["labels"] = dict(labels)
    if kind == "Secret":
        obj["type"] = generator.get("type", "Opaque")
        obj["data"] = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    else:
        obj["data"] = data
    return obj


def _patch_documents(patch: Object, directory: Path) -> list[Object]:
    if "target" in patch:
        raise RenderError("patches with an explicit `target` are not implemented: name the "
                          "target by the patch's own kind and metadata.name")
    if "path" in patch:
        return _load_documents(directory / patch["path"])
    return [d for d in yaml.safe_load_all(patch["patch"]) if d is not None]


def _apply_patch(objects: list[Object], patch: Object, where: Path) -> None:
    kind, name = patch["kind"], patch["metadata"]["name"]
    for i, obj in enumerate(objects):
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            objects[i] = strategic_merge(obj, patch)
            return
    raise RenderError(f"{where}: a patch targets {kind}/{name}, which no resource defines")


def strategic_merge(base: Any, patch: Any) -> Any:
    """`patch` merged into a copy of `base` (see the module docstring for the rules)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            elif key in merged:
                merged[key] = strategic_merge(merged[key], value)
            else:
                merged[key] = copy.deepcopy(value)
        return merged
    if (isinstance(base, list) and isinstance(patch, list) and base and patch
            and all(isinstance(item, dict) and "name" in item for item in base + patch)):
        merged_list = copy.deepcopy(base)
        positions = {item["name"]: i for i, item in enumerate(merged_list)}
        for item in patch:
            if item["name"] in positions:
                i = positions[item["name"]]
                merged_list[i] = strategic_merge(merged_list[i], item)
            else:
                merged_list.append(copy.deepcopy(item))
        return merged_list
    return copy.deepcopy(patch)


def _set_replicas(objects: list[Object], name: str, count: int, where: Path) -> None:
    targets = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")
               and o["metadata"]["name"] == name]
    if not targets:
        raise RenderError(f"{where}: replicas for {name}, which is no Deployment or StatefulSet")
    for obj in targets:
        obj["spec"]["replicas"] = count


def _split_image(reference: str) -> tuple[str, str | None]:
    """repository[:tag][@digest] -> (repository, tag); a registry's :port is no tag."""
    name = reference.split("@")[0]
    if ":" in name.rsplit("/", 1)[-1]:
        repository, tag = name.rsplit(":", 1)
        return repository, tag
    return name, None


def _set_image(objects: list[Object], image: Object) -> None:
    for obj in objects:
        pod = obj.get("spec", {}).get("template", {}).get("spec", {})
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            repository, tag = _split_image(container.get("image", ""))
            if repository != image["name"]:
                continue
            new = image.get("newName", repository)
            if "digest" in image:
                container["image"] = f"{new}@{image['digest']}"
            else:
                container["image"] = f"{new}:{image.get('newTag', tag or 'latest')}"


def _check_unique(objects: list[Object], where: Path) -> None:
    seen: set[tuple[str, str]] = set()
    for obj in objects:
        key = (obj["kind"], obj["metadata"]["name"])
        if key in seen:
            raise RenderError(f"{where}: {key[0]}/{key[1]} is defined twice")
        seen.add(key)


def in_apply_order(objects: list[Object]) -> list[Object]:
    rank = {kind: i for i, kind in enumerate(APPLY_ORDER)}
    return sorted(objects, key=lambda o: rank.get(o["kind"], len(APPLY_ORDER)))


def write(objects: list[Object], out: str) -> list[Path]:
    """One NN-kind-name.yaml per object under directory `out` (made if missing), or, for `-`,
    one multi-document stream on stdout. Returns the files written."""
    ordered = in_apply_order(objects)
    if out == "-":
        yaml.safe_dump_all(ordered, sys.stdout, sort_keys=False)
        return []
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, obj in enumerate(ordered):
        path = directory / f"{i:02d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(obj, sort_keys=False))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deploy/render.py", description=__doc__.split("\n")[0])
    parser.add_argument("kustomization", type=Path, help="a folder with a kustomization.yaml")
    parser.add_argument("out", help="output folder, or - for stdout")
    parser.add_argument("--file", action="append", default=[], metavar="KEY=PATH",
                        help="read a generator's file KEY from PATH instead (repeatable)")
    args = parser.parse_args(argv)
    try:
        overrides = {}
        for entry in args.file:
            key, sep, path = entry.partition("=")
            if not sep or not key or not path:
                raise RenderError(f"--file takes KEY=PATH, got {entry!r}")
            overrides[key] = Path(path)
        paths = write(render(args.kustomization, overrides), args.out)
    except (RenderError, OSError, yaml.YAMLError, KeyError) as exc:
        print(f"render: {exc}", file=sys.stderr)
        return 2
    if paths:
        print(f"wrote {len(paths)} manifests to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

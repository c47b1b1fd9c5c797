"""What a cluster would refuse among `toolkit launch --on kubernetes`'s options, each refused in one line before the
manifest is written, by the rules the engines themselves apply (cited where each is written): an image reference,
a resource quantity, a node label, a toleration."""

from __future__ import annotations

import re
from decimal import Decimal

from ..errors import ConfigError, warn

# An image reference: github.com/distribution/reference v0.6.0 regexp.go (ReferenceRegexp), the grammar the kubelet
# and containerd parse `image` with (ParseNormalizedNamed, normalize.go). Go's \w and [[:xdigit:]] are ASCII.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*"
_DOMAIN_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = rf"(?:{_DOMAIN_PART}(?:\.{_DOMAIN_PART})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
REFERENCE = re.compile(rf"(?:({_HOST})/)?({_COMPONENT}(?:/{_COMPONENT})*)(?::([A-Za-z0-9_][\w.-]{{0,127}}))?"
                       rf"(?:@({_DIGEST}))?", re.ASCII)  # fmt: skip
DIGEST_HEX = {"sha256": 64, "sha384": 96, "sha512": 128}  # opencontainers/go-digest's algorithms, lower-case hex
IMAGE_FORM = "[registry[:port]/]lower-case/path[:tag][@sha256:<64 hex>]"

# A resource quantity: the pattern the API server checks resourcesPerNode's values with (Trainer v2.3.0's TrainJob
# CRD, from apimachinery's resource.Quantity grammar). The official client's kubernetes.utils.parse_quantity is
# laxer (it takes ' 8Gi', '1e3Gi', 'NaN', '1_000', which the server refuses), so it is no check; tests compare
# the values with it.
_NUMBER = r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
QUANTITY = re.compile(rf"{_NUMBER}(?:[KMGTPE]i|[numkMGTPE]|[eE]{_NUMBER})?")
SUFFIXES = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": 1, "k": 10**3, "M": 10**6,
            "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
            "Pi": 2**50, "Ei": 2**60}  # fmt: skip

# A label's key and value, a taint's key: kubernetes/apimachinery pkg/util/validation/validation.go (IsQualifiedName,
# IsValidLabelValue, IsDNS1123Subdomain for a key's prefix); a toleration: kubernetes pkg/apis/core/validation
# (ValidateTolerations, validateTaintEffect).
QUALIFIED = re.compile(r"(?:[A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
SUBDOMAIN = re.compile(r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*")
EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
LABEL_FORM = "[prefix/]name; a name or value: at most 63 letters, digits, '-', '_', '.', alphanumeric at both ends"


def check_image(image: str) -> None:
    """Refuse a reference the nodes could not pull; warn of one whose code may change between restarts."""
    match = REFERENCE.fullmatch(image)
    if re.fullmatch(r"[a-f0-9]{64}", image):
        raise ConfigError(f"--image {image}: a 64-hex string is an image ID, which a node cannot pull; pass the "
                          "image's name, with @sha256:<digest> to pin it.")  # fmt: skip
    if match is None:
        if REFERENCE.fullmatch(image.lower()):
            raise ConfigError(f"--image {image!r}: write the repository in lower case ({IMAGE_FORM}).")
        raise ConfigError(f"--image {image!r} is no image reference a node can pull: use {IMAGE_FORM}, a tag of at "
                          "most 128 letters, digits, '_', '.', '-' (distribution/reference's grammar).")  # fmt: skip
    domain, path, tag, digest = match.groups()
    if domain and not (domain == "localhost" or ":" in domain or "." in domain or domain.lower() != domain):
        path = f"{domain}/{path}"  # a first part like 'acme' is Docker Hub's namespace, not a registry
    if len(path) > 255:
        raise ConfigError(f"--image: the repository path has {len(path)} characters, at most 255.")
    if digest:
        algorithm, _, hexes = digest.partition(":")
        if DIGEST_HEX.get(algorithm) != len(hexes) or not re.fullmatch("[a-f0-9]+", hexes):
            raise ConfigError(f"--image {image!r}: the digest is not sha256:<64 lower-case hex digits> (or sha384, "
                              "sha512): copy it from `docker inspect` or the registry.")  # fmt: skip
    elif tag in (None, "latest"):
        warn(f"--image {image} is {'untagged, so ' if tag is None else ''}:latest, which the kubelet pulls anew on "
             "each restart: nodes restarted after a preemption may run other code than the checkpoint's. Pin a "
             "version tag or @sha256 digest.")  # fmt: skip


def quantity(text: str, option: str, example: str) -> Decimal:
    """A Kubernetes quantity's value, refused in one line where the API server would refuse it or it is not
    above 0."""
    if not QUANTITY.fullmatch(text):
        raise ConfigError(f"{option} {text!r} is no Kubernetes quantity: a number and an optional suffix, e.g. "
                          f"{example} (Ki Mi Gi Ti: powers of 1024; k M G T: of 1000; m: thousandths).")  # fmt: skip
    number = text.rstrip("KMGTPEinumk")
    value = Decimal(number) * SUFFIXES[text[len(number) :]]
    if value <= 0:
        raise ConfigError(f"{option} {text}: pass what a node gives the pod, above 0, e.g. {example}.")
    return value


def label_problem(key: str, value: str | None = None) -> str | None:
    """What Kubernetes refuses in a label (or taint) key and value, None where it takes them."""
    parts = key.split("/")
    name, prefix = parts[-1], parts[0] if len(parts) == 2 else None
    if len(parts) > 2 or not (0 < len(name) <= 63 and QUALIFIED.fullmatch(name)):
        return f"the key {key!r} is no label key ({LABEL_FORM})"
    if prefix is not None and not (0 < len(prefix) <= 253 and SUBDOMAIN.fullmatch(prefix)):
        return f"the key's prefix {prefix!r} is no DNS subdomain (lower-case letters, digits, '-', '.')"
    if value and not (len(value) <= 63 and QUALIFIED.fullmatch(value)):
        return f"the value {value!r} is no label value ({LABEL_FORM})"
    return None


def node_selector(words: list[str]) -> dict[str, str]:
    """--node_selector key=value (repeated): the node labels a pod's node must have."""
    selector: dict[str, str] = {}
    for text in words:
        key, equals, value = text.partition("=")
        problem = label_problem(key, value) if equals else "use key=value"
        if problem is None and selector.get(key, value) != value:
            problem = f"the key {key!r} is given twice with different values"
        if problem:
            raise ConfigError(f"--node_selector {text!r}: {problem}; e.g. --node_selector "
                              "cloud.google.com/gke-accelerator=nvidia-h100-80gb.")  # fmt: skip
        selector[key] = value
    return selector


def tolerations(words: list[str]) -> list[dict]:
    """--toleration key[=value]:Effect (repeated), a node taint as `kubectl taint` writes it: tolerated where the
    key (and value, if given) and the effect match."""
    found = []
    for text in words:
        body, colon, effect = text.rpartition(":")
        key, equals, value = body.partition("=")
        problem = label_problem(key, value) if colon else "use key[=value]:Effect"
        if problem is None and effect not in EFFECTS:
            problem = f"the effect {effect!r} is none of {', '.join(EFFECTS)}"
        if problem:
            raise ConfigError(f"--toleration {text!r}: {problem}; e.g. --toleration "
                              "nvidia.com/gpu=present:NoSchedule.")  # fmt: skip
        matching = {"operator": "Equal", "value": value} if equals else {"operator": "Exists"}
        found.append({"key": key, **matching, "effect": effect})
    return found

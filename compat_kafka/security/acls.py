"""Kafka ACLs, sans-IO: bindings, filters and the authorization decision.

How this works. An ACL binding is a resource pattern (resource type, name, pattern type LITERAL or
PREFIXED) and an entry (principal such as ``User:alice`` or ``User:*``, host ``*`` or an IP,
operation, ALLOW or DENY). The decision follows Kafka's ``AclAuthorizer``/``StandardAuthorizer``:
superusers may do anything; otherwise the bindings whose pattern matches the resource (a LITERAL
of the same name or of ``*``, or a PREFIXED whose name starts the resource name) and whose
principal and host match are considered; a matching DENY for the operation (or ALL) refuses; a
matching ALLOW for the operation, for ALL or for an operation that implies it (DESCRIBE is implied
by READ, WRITE, DELETE and ALTER; DESCRIBE_CONFIGS by ALTER_CONFIGS) allows; nothing matching
refuses (``allow.everyone.if.no.acl.found`` is false). Filters (DescribeAcls, DeleteAcls) match
bindings as Kafka's ``AclBindingFilter``: ANY matches every value, null names/principals/hosts
match anything, and the MATCH pattern type matches every pattern that would apply to the name.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass


class ResourceType(enum.IntEnum):
    UNKNOWN = 0
    ANY = 1
    TOPIC = 2
    GROUP = 3
    CLUSTER = 4
    TRANSACTIONAL_ID = 5
    DELEGATION_TOKEN = 6
    USER = 7


class PatternType(enum.IntEnum):
    UNKNOWN = 0
    ANY = 1
    MATCH = 2
    LITERAL = 3
    PREFIXED = 4


class Operation(enum.IntEnum):
    UNKNOWN = 0
    ANY = 1
    ALL = 2
    READ = 3
    WRITE = 4
    CREATE = 5
    DELETE = 6
    ALTER = 7
    DESCRIBE = 8
    CLUSTER_ACTION = 9
    DESCRIBE_CONFIGS = 10
    ALTER_CONFIGS = 11
    IDEMPOTENT_WRITE = 12
    CREATE_TOKENS = 13
    DESCRIBE_TOKENS = 14


class Permission(enum.IntEnum):
    UNKNOWN = 0
    ANY = 1
    DENY = 2
    ALLOW = 3


CLUSTER_NAME = "kafka-cluster"
WILDCARD = "*"
WILDCARD_PRINCIPAL = "User:*"
ANONYMOUS = "User:ANONYMOUS"

# operations that, allowed, also allow the key (Kafka's AclEntry.supportedOperations implication)
_IMPLIED_BY: dict[Operation, frozenset[Operation]] = {
    Operation.DESCRIBE: frozenset({Operation.DESCRIBE, Operation.READ, Operation.WRITE, Operation.DELETE,
                                   Operation.ALTER}),
    Operation.DESCRIBE_CONFIGS: frozenset({Operation.DESCRIBE_CONFIGS, Operation.ALTER_CONFIGS}),
}


class InvalidAcl(ValueError):
    """A binding or filter Kafka refuses (answered INVALID_REQUEST)."""


def _enum(cls, value):
    try:
        return cls(value)
    except ValueError:
        return cls.UNKNOWN


def check_principal(principal: str) -> None:
    kind, sep, name = principal.partition(":")
    if not sep or not kind or not name:
        raise InvalidAcl(f"invalid principal {principal!r}: expected Type:name, e.g. User:alice")


@dataclass(frozen=True, slots=True)
class AclBinding:
    resource_type: ResourceType
    name: str
    pattern_type: PatternType
    principal: str
    host: str
    operation: Operation
    permission: Permission

    @classmethod
    def make(cls, resource_type, name, pattern_type, principal, host, operation, permission) -> AclBinding:
        """A binding as CreateAcls gets it, checked as Kafka checks it (``InvalidAcl``)."""
        b = cls(_enum(ResourceType, resource_type), name, _enum(PatternType, pattern_type), principal, host,
                _enum(Operation, operation), _enum(Permission, permission))
        if b.resource_type in (ResourceType.UNKNOWN, ResourceType.ANY):
            raise InvalidAcl("the resource type must be a concrete one (not ANY or UNKNOWN)")
        if b.pattern_type not in (PatternType.LITERAL, PatternType.PREFIXED):
            raise InvalidAcl("the pattern type must be LITERAL or PREFIXED")
        if b.operation in (Operation.UNKNOWN, Operation.ANY):
            raise InvalidAcl("the operation must be a concrete one (not ANY or UNKNOWN)")
        if b.permission not in (Permission.ALLOW, Permission.DENY):
            raise InvalidAcl("the permission type must be ALLOW or DENY")
        if not name:
            raise InvalidAcl("the resource name must not be empty")
        if b.resource_type == ResourceType.CLUSTER and (name != CLUSTER_NAME or b.pattern_type != PatternType.LITERAL):
            raise InvalidAcl(f"the cluster resource is the LITERAL {CLUSTER_NAME!r}")
        if b.pattern_type == PatternType.PREFIXED and name == WILDCARD:
            raise InvalidAcl("a PREFIXED pattern cannot be the wildcard '*'")
        check_principal(principal)
        if not host:
            raise InvalidAcl("the host must be '*' or an address")
        return b

    def key(self) -> str:
        """A stable store key for this binding (the same binding created twice is one key)."""
        return hashlib.sha256(self.to_bytes()).hexdigest()[:40]

    def to_bytes(self) -> bytes:
        return json.dumps([int(self.resource_type), self.name, int(self.pattern_type), self.principal, self.host,
                           int(self.operation), int(self.permission)]).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> AclBinding:
        rt, name, pt, principal, host, op, perm = json.loads(data)
        return cls(ResourceType(rt), name, PatternType(pt), principal, host, Operation(op), Permission(perm))

    def applies_to(self, resource_type: ResourceType, name: str) -> bool:
        if resource_type != self.resource_type:
            return False
        if self.pattern_type == PatternType.LITERAL:
            return self.name == name or self.name == WILDCARD
        return name.startswith(self.name)


@dataclass(frozen=True, slots=True)
class AclFilter:
    """DescribeAcls/DeleteAcls filter; None name/principal/host match anything."""

    resource_type: ResourceType
    name: str | None
    pattern_type: PatternType
    principal: str | None
    host: str | None
    operation: Operation
    permission: Permission

    @classmethod
    def make(cls, resource_type, name, pattern_type, principal, host, operation, permission) -> AclFilter:
        f = cls(_enum(ResourceType, resource_type), name, _enum(PatternType, pattern_type), principal, host,
                _enum(Operation, operation), _enum(Permission, permission))
        if UNKNOWN_IN(f):
            raise InvalidAcl("the filter must not contain UNKNOWN elements")
        return f

    def matches(self, b: AclBinding) -> bool:
        if self.resource_type != ResourceType.ANY and self.resource_type != b.resource_type:
            return False
        if not self._pattern_matches(b):
            return False
        return ((self.principal is None or self.principal == b.principal)
                and (self.host is None or self.host == b.host)
                and (self.operation == Operation.ANY or self.operation == b.operation)
                and (self.permission == Permission.ANY or self.permission == b.permission))

    def _pattern_matches(self, b: AclBinding) -> bool:
        if self.pattern_type == PatternType.MATCH:
            if self.name is None:
                return True
            if b.pattern_type == PatternType.LITERAL:
                return b.name == self.name or b.name == WILDCARD
            return self.name.startswith(b.name)
        if self.pattern_type != PatternType.ANY and self.pattern_type != b.pattern_type:
            return False
        return self.name is None or self.name == b.name


def UNKNOWN_IN(f: AclFilter) -> bool:  # noqa: N802
    return (f.resource_type == ResourceType.UNKNOWN or f.pattern_type == PatternType.UNKNOWN
            or f.operation == Operation.UNKNOWN or f.permission == Permission.UNKNOWN)


class AclSet:
    """The bindings in force, indexed by resource type, and the decision (``authorize``)."""

    def __init__(self, bindings=(), super_users: frozenset[str] = frozenset()):
        self.bindings: tuple[AclBinding, ...] = tuple(bindings)
        self.super_users = frozenset(super_users)
        self._by_type: dict[ResourceType, list[AclBinding]] = {}
        for b in self.bindings:
            self._by_type.setdefault(b.resource_type, []).append(b)

    def authorize(self, principal: str, host: str, resource_type: ResourceType, name: str, op: Operation) -> bool:
        if principal in self.super_users:
            return True
        allow_ops = _IMPLIED_BY.get(op, frozenset({op}))
        allowed = False
        for b in self._by_type.get(resource_type, ()):
            if b.principal != principal and b.principal != WILDCARD_PRINCIPAL:
                continue
            if b.host != WILDCARD and b.host != host:
                continue
            if not b.applies_to(resource_type, name):
                continue
            if b.permission == Permission.DENY:
                if b.operation == op or b.operation == Operation.ALL:
                    return False
            elif b.operation == Operation.ALL or b.operation in allow_ops:
                allowed = True
        return allowed

    def any_allowed(self, principal: str, host: str, resource_type: ResourceType, op: Operation) -> bool:
        """Whether some resource of the type may be used so (``authorizeByResourceType``, e.g. an
        idempotent producer allowed WRITE on any topic): an ALLOW for the principal, unless a DENY of
        the whole type (a LITERAL ``*``) applies."""
        if principal in self.super_users:
            return True
        allow_ops = _IMPLIED_BY.get(op, frozenset({op}))
        allowed = False
        for b in self._by_type.get(resource_type, ()):
            if b.principal not in (principal, WILDCARD_PRINCIPAL) or b.host not in (WILDCARD, host):
                continue
            if b.permission == Permission.DENY:
                if (b.operation in (op, Operation.ALL) and b.pattern_type == PatternType.LITERAL
                        and b.name == WILDCARD):
                    return False
            elif b.operation == Operation.ALL or b.operation in allow_ops:
                allowed = True
        return allowed

    def matching(self, f: AclFilter) -> list[AclBinding]:
        return [b for b in self.bindings if f.matches(b)]


def parse_super_users(text: str) -> frozenset[str]:
    """``User:admin;User:ops`` (Kafka's ``super.users``) -> the principals, checked."""
    users = frozenset(u.strip() for u in text.split(";") if u.strip())
    for u in users:
        check_principal(u)
    return users


def principal_from_dn(subject) -> str:
    """A TLS peer certificate's subject (``ssl.getpeercert()['subject']``) as Kafka's default
    principal builder names it: ``User:CN=client,O=org`` (RFC 2253 order: most specific first)."""
    short = {"commonName": "CN", "organizationName": "O", "organizationalUnitName": "OU", "countryName": "C",
             "stateOrProvinceName": "ST", "localityName": "L", "domainComponent": "DC", "userId": "UID",
             "streetAddress": "STREET"}
    parts = []
    for rdn in reversed(subject or ()):
        parts.append("+".join(f"{short.get(k, k)}={_dn_escape(v)}" for k, v in rdn))
    return "User:" + ",".join(parts)


def _dn_escape(v: str) -> str:
    out = "".join("\\" + c if c in ',+"\\<>;=' else c for c in v)
    if out.startswith((" ", "#")):
        out = "\\" + out
    if out.endswith(" ") and not out.endswith("\\ "):
        out = out[:-1] + "\\ "
    return out

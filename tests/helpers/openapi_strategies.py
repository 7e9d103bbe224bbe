"""Hypothesis strategies for request bodies, generated from a server's own OpenAPI schema (what schemathesis does,
in a page): each JSON schema of FastAPI's `app.openapi()` (objects, arrays, anyOf, $ref, enum / const, the scalar
types) becomes a strategy of JSON values that mostly fit it, with hostile values mixed in where a careless or
malicious client would put them: integers beyond int64 and negative ones, NaN and infinities, wrong types, unknown
fields. `overrides` bounds the fields whose valid values would make a request slow rather than wrong (`n`,
`max_tokens`): a fuzzer looks for crashes and hangs, not for the cost of a large valid request."""

from hypothesis import strategies as st

HOSTILE_INTS = [-1, 0, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]
HOSTILE_FLOATS = [float("nan"), float("inf"), -float("inf"), 1e308, -0.0, 1e-320]


def json_values(depth: int = 2) -> st.SearchStrategy:
    """Any JSON value, a little nested."""
    scalars = st.none() | st.booleans() | st.integers(-5, 5) | st.sampled_from(HOSTILE_INTS) | st.text(max_size=8)
    if depth == 0:
        return scalars
    inner = json_values(depth - 1)
    return scalars | st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)


def integers(schema: dict) -> st.SearchStrategy:
    lo, hi = schema.get("minimum", -5), schema.get("maximum", 40)
    fits = st.integers(max(lo, -5), min(hi, max(lo, -5) + 45))
    return st.one_of(fits, fits, fits, st.sampled_from(HOSTILE_INTS))


def numbers(schema: dict) -> st.SearchStrategy:
    return st.floats(-3, 3, allow_nan=False) | st.integers(-3, 3) | st.sampled_from(HOSTILE_FLOATS)


class SchemaStrategies:
    def __init__(self, openapi: dict, overrides: dict[str, st.SearchStrategy] | None = None) -> None:
        self.schemas = openapi.get("components", {}).get("schemas", {})
        self.overrides = overrides or {}

    def body(self, openapi: dict, path: str) -> st.SearchStrategy:
        """Bodies for POST `path`."""
        schema = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        return self.of(schema)

    def of(self, schema: dict, depth: int = 0) -> st.SearchStrategy:
        if "$ref" in schema:
            return self.of(self.schemas[schema["$ref"].rsplit("/", 1)[1]], depth)
        if "anyOf" in schema:
            return st.one_of([self.of(s, depth) for s in schema["anyOf"]])
        if "enum" in schema:
            return st.sampled_from(schema["enum"]) | st.text(max_size=5)
        if "const" in schema:
            return st.just(schema["const"]) | st.text(max_size=5)
        kind = schema.get("type")
        if depth > 4 or kind is None:
            return json_values()
        if kind == "object":
            return self.object(schema, depth)
        if kind == "array":
            items = self.of(schema.get("items", {}), depth + 1)
            return st.lists(items, min_size=schema.get("minItems", 0), max_size=4)
        return dict(
            string=st.text(max_size=24),
            integer=integers(schema),
            number=numbers(schema),
            boolean=st.booleans(),
            null=st.none(),
        )[kind]

    def object(self, schema: dict, depth: int) -> st.SearchStrategy:
        props = schema.get("properties", {})
        if not props:
            return st.dictionaries(st.text(max_size=8), json_values(1), max_size=3)
        field = lambda name, s: self.overrides[name] if name in self.overrides else self.of(s, depth + 1)
        required = {k: field(k, s) for k, s in props.items() if k in schema.get("required", [])}
        optional = {k: field(k, s) for k, s in props.items() if k not in required}
        fitting = st.fixed_dictionaries(required, optional=optional)
        if depth > 0:
            return fitting
        # the request itself: mostly the required fields and a few others (with every field present, one of them is
        # nearly always out of range: nothing would get past the checks), sometimes every field, unknown fields,
        # or not an object at all
        names = st.lists(st.sampled_from(sorted(optional)), max_size=3, unique=True) if optional else st.just([])
        sparse = names.flatmap(lambda keys: st.fixed_dictionaries({**required, **{k: optional[k] for k in keys}}))
        extra = st.dictionaries(st.sampled_from(["x_unknown", "foo", "__proto__"]), json_values(1), max_size=1)
        with_extra = st.builds(lambda a, b: {**a, **b}, sparse, extra)
        wrong = json_values(1).filter(lambda v: not isinstance(v, dict))
        return st.one_of(sparse, sparse, sparse, fitting, with_extra, wrong)

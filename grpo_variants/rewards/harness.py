"""What runs inside the two sandboxes of a code test (stdlib only; its source is each run's script).

* :func:`serve_program` runs in the **program's process**: it executes the program, sends a manifest of
  the names it defines, then answers requests (call this, read that attribute, iterate that) one line
  each. Its only input is what the requests carry: the arguments of a call, as values.
* :func:`serve_tests` runs in the **reference process**, which never holds the program: for each test
  file it forks a child that runs the file as Python, unmodified, with every name of the program bound
  to a :class:`Remote` stub. A stub sends the call's arguments and gets back the return value and the
  arguments' values after the call (copied back in place). Instances of the test file's plain classes
  cross as an object graph (:class:`Graph`) both ways. Any other non-plain value comes back as a handle
  (another :class:`Remote`): calls, attribute reads, iteration, ``len``, ``bool`` and ``str`` go to the
  program; comparison, hashing and containment never do (they would ship the other side) and fail the
  test.

Lines between the two go through the trainer (``C`` a request, ``R`` its answer, ``X`` the program is
gone, ``U`` a test's result, ``E`` the file is done). Values cross as JSON restricted to the types tests
compare (:func:`encode` / :func:`decode`), bounded in depth and element count.
"""

from __future__ import annotations

import builtins
import collections
import json
import os
import signal
import sys

MAX_DEPTH = 64
MAX_ELEMENTS = 200_000
_BIG = 1 << 62
_BUILTIN_TYPES = {"int": int, "list": list, "set": set, "dict": dict, "str": str, "float": float, "tuple": tuple,
                  "frozenset": frozenset, "bool": bool, "bytes": bytes}


class Refused(BaseException):
    """The judge refuses what the test asked (no ``except Exception`` in a test can swallow it)."""


# --------------------------------------------------------------------------------------------
# Values on the wire
# --------------------------------------------------------------------------------------------
def encode(v, other, d=0, n=None):
    """The JSON form of ``v``; ``other(v)`` encodes (or refuses) anything that is not plain data."""
    if n is None:
        n = [MAX_ELEMENTS]
    n[0] -= 1
    if n[0] < 0 or d > MAX_DEPTH:
        raise ValueError("value too large or too deeply nested to send")
    if v is None or v is True or v is False:
        return v
    t, e = type(v), lambda x: encode(x, other, d + 1, n)
    if t is str or t is float:
        return v
    if isinstance(v, int) and not isinstance(v, bool):
        v = int(v)
        return v if -_BIG < v < _BIG else {"i": format(v, "x")}
    if isinstance(v, str):
        return str.__str__(v)
    if isinstance(v, float):
        return float(v)
    if isinstance(v, list):
        return [e(x) for x in list.__iter__(v)]
    if isinstance(v, tuple):
        return {"t": [e(x) for x in tuple.__iter__(v)]}
    pairs = lambda m: [[e(k), e(x)] for k, x in dict.items(m)]  # noqa: E731
    if isinstance(v, collections.Counter):
        return {"C": pairs(v)}
    if isinstance(v, collections.OrderedDict):
        return {"od": pairs(v)}
    if isinstance(v, collections.defaultdict):
        f = v.default_factory
        return {"dd": [next((k for k, c in _BUILTIN_TYPES.items() if c is f), None), pairs(v)]}
    if isinstance(v, dict):
        return {"d": pairs(v)}
    if isinstance(v, frozenset):
        return {"fs": [e(x) for x in frozenset.__iter__(v)]}
    if isinstance(v, set):
        return {"s": [e(x) for x in set.__iter__(v)]}
    if isinstance(v, bytes):
        return {"b": bytes(v).hex()}
    if isinstance(v, bytearray):
        return {"ba": bytes(v).hex()}
    if isinstance(v, complex):
        return {"c": [complex(v).real, complex(v).imag]}
    if isinstance(v, collections.deque):
        return {"q": [[e(x) for x in v], v.maxlen]}
    # A Fraction or Decimal exists only where its module was imported (not imported here: a program's start-up
    # stays as cheap as it was before the harness).
    fr, dec = sys.modules.get("fractions"), sys.modules.get("decimal")
    if fr is not None and isinstance(v, getattr(fr, "Fraction", ())):
        return {"F": [e(v.numerator), e(v.denominator)]}
    if dec is not None and isinstance(v, getattr(dec, "Decimal", ())):
        return {"D": str(v)}
    if isinstance(v, range):
        return {"r": [e(v.start), e(v.stop), e(v.step)]}
    if t in _VIEWS:
        return {_VIEWS[t]: [e(x) for x in v] if _VIEWS[t] != "di" else [[e(k), e(x)] for k, x in v]}
    if hasattr(v, "tolist") and type(v).__module__.split(".")[0] == "numpy":
        return e(v.tolist())
    return other(v)


_VIEWS = {type({}.keys()): "dk", type({}.values()): "dv", type({}.items()): "di"}


def _hashable_set(items):
    """Refuse a flood of elements whose hashes are equal (quadratic to build, and never a real set)."""
    counts = collections.Counter(hash(x) for x in items)
    if counts and max(counts.values()) > 64:
        raise ValueError("elements that all hash alike")
    return items


def _hashable_keys(pairs):
    _hashable_set([k for k, _ in pairs])
    return pairs


def decode(o, resolve, d=0, n=None, nodes=()):
    """The value of a JSON form from :func:`encode`; ``resolve(id)`` gives the value of a handle, ``nodes`` the
    objects a ``{"o": index}`` refers to (see :class:`Graph`)."""
    if n is None:
        n = [MAX_ELEMENTS]
    n[0] -= 1
    if n[0] < 0 or d > MAX_DEPTH + 2:
        raise ValueError("value too large or too deeply nested")
    t = type(o)
    if o is None or t is bool or t is int or t is float or t is str:
        return o
    de = lambda x: decode(x, resolve, d + 1, n, nodes)  # noqa: E731
    if t is list:
        return [de(x) for x in o]
    if t is not dict or len(o) != 1:
        raise ValueError("not a value")
    (tag, p), = o.items()
    seq = lambda: [de(x) for x in p] if type(p) is list else _bad()  # noqa: E731
    pairs = lambda q: _hashable_keys([(de(k), de(x)) for k, x in q]) if type(q) is list else _bad()  # noqa: E731
    if tag == "i" and type(p) is str and len(p) < 100_000:
        return int(p, 16)
    if tag == "t":
        return tuple(seq())
    if tag in ("s", "fs"):
        return (set if tag == "s" else frozenset)(_hashable_set(seq()))
    if tag in ("d", "od", "C"):
        return {"d": dict, "od": collections.OrderedDict, "C": collections.Counter}[tag](dict(pairs(p)))
    if tag == "dd" and type(p) is list and len(p) == 2:
        return collections.defaultdict(_BUILTIN_TYPES.get(p[0]) if type(p[0]) is str else None, dict(pairs(p[1])))
    if tag in ("b", "ba") and type(p) is str:
        return (bytes if tag == "b" else bytearray).fromhex(p)
    if tag == "c" and type(p) is list and len(p) == 2 and all(type(x) in (int, float) for x in p):
        return complex(float(p[0]), float(p[1]))
    if tag == "q" and type(p) is list and len(p) == 2 and (p[1] is None or type(p[1]) is int):
        return collections.deque(de(p[0]) if type(p[0]) is list else _bad(), p[1])
    if tag == "F" and type(p) is list and len(p) == 2:
        import fractions

        return fractions.Fraction(*[_int(de(x)) for x in p])
    if tag == "D" and type(p) is str and len(p) < 10_000:
        import decimal

        return decimal.Decimal(p)
    if tag == "r" and type(p) is list and len(p) == 3:
        return range(*[_int(de(x)) for x in p])
    if tag == "dk":
        return dict.fromkeys(_hashable_set(seq())).keys()
    if tag == "dv":
        return dict(enumerate(seq())).values()
    if tag == "di":
        return dict(pairs(p)).items()
    if tag == "h" and type(p) is int:
        return resolve(p)
    if tag == "o" and type(p) is int and 0 <= p < len(nodes):
        return nodes[p]
    raise ValueError("unknown value")


def _int(x):
    return x if type(x) is int else _bad()


def _bad():
    raise ValueError("malformed value")


def copy_into(dst, src):
    """Make the mutable ``dst`` equal to ``src`` in place, keeping the identity of nested containers."""
    if isinstance(dst, list) and isinstance(src, list):
        for i in range(min(len(dst), len(src))):
            dst[i] = _merge(dst[i], src[i])
        del dst[len(src):]
        dst.extend(src[len(dst):])
    elif isinstance(dst, dict) and isinstance(src, dict):
        old = dict(dst)
        dst.clear()
        for k, v in src.items():
            dst[k] = _merge(old[k], v) if k in old else v
    elif isinstance(dst, (set, collections.deque)) and isinstance(src, type(dst)):
        dst.clear()
        dst.update(src) if isinstance(dst, set) else dst.extend(src)
    elif isinstance(dst, bytearray) and isinstance(src, bytearray):
        dst[:] = src
    elif isinstance(dst, tuple) and isinstance(src, tuple) and len(dst) == len(src):
        for a, b in zip(dst, src):
            copy_into(a, b)


def _merge(old, new):
    if isinstance(old, (list, dict, set, bytearray, collections.deque)) and type(old) is type(new):
        copy_into(old, new)
        return old
    return new


def _mutable(v):
    return isinstance(v, (list, dict, set, bytearray, collections.deque)) or (
        isinstance(v, tuple) and any(_mutable(x) for x in v))


# --------------------------------------------------------------------------------------------
# Objects that cross as data (a test's TreeNode, ListNode, Node): a graph
# --------------------------------------------------------------------------------------------
class Graph:
    """Instances of the classes that cross as data, as one table of nodes ``[class name, {attribute:
    value}]``; a value refers to node ``i`` as ``{"o": i}``. Nodes are encoded one after another, never
    nested in each other, so a 10,000-node list is as deep as one node, and a shared node or a cycle is
    one node. One element count bounds the whole message (nodes and values together). ``is_node(v)``:
    does ``v`` cross as a node; ``other(v)``: the form of anything else that is not plain data."""

    def __init__(self, is_node, other, seed=()):
        self.is_node, self.other, self.n = is_node, other, [MAX_ELEMENTS]
        self.objs, self.ids = [], {}
        for v in seed:
            self.ref(v)

    def ref(self, v):
        i = self.ids.get(id(v))
        if i is None:
            self.n[0] -= 1
            i = self.ids[id(v)] = len(self.objs)
            self.objs.append(v)
        return {"o": i}

    def encode(self, v):
        return encode(v, lambda x: self.ref(x) if self.is_node(x) else self.other(x), 0, self.n)

    def table(self):
        out = []
        while len(out) < len(self.objs):  # encoding a node's attributes may add nodes
            v = self.objs[len(out)]
            out.append([type(v).__name__, {k: self.encode(x) for k, x in _state(v).items()}])
        return out


def _state(v):
    """An object's attributes: its ``__dict__`` and its slots (str names only)."""
    try:
        d = dict(object.__getattribute__(v, "__dict__"))
    except AttributeError:
        d = {}
    for c in type(v).__mro__:
        slots = c.__dict__.get("__slots__", ())
        for k in [slots] if isinstance(slots, str) else slots:
            if k not in ("__dict__", "__weakref__"):
                try:
                    d[k] = object.__getattribute__(v, k)
                except AttributeError:
                    pass
    return {k: x for k, x in d.items() if type(k) is str}


def decode_graph(table, make, resolve, n):
    """The nodes of a :class:`Graph` table: ``make(i, class name)`` gives node ``i`` (every node exists before
    any attribute is decoded, so attributes may refer to any), then each node's attributes are decoded.
    Returns ``(nodes, states)``; bounded by the element count ``n`` as :func:`decode` is."""
    if type(table) is not list or len(table) > MAX_ELEMENTS:
        _bad()
    nodes = []
    for i, node in enumerate(table):
        n[0] -= 1
        if n[0] < 0 or type(node) is not list or len(node) != 2 or type(node[0]) is not str \
                or not node[0].isidentifier() or type(node[1]) is not dict:
            _bad()
        nodes.append(make(i, node[0]))
    return nodes, [{k: decode(x, resolve, 0, n, nodes) for k, x in node[1].items()} for node in table]


# --------------------------------------------------------------------------------------------
# Lines on a pair of descriptors
# --------------------------------------------------------------------------------------------
class Pipe:
    def __init__(self, rfd, wfd):
        self.r, self.w, self.buf = rfd, wfd, b""

    def readline(self):
        while b"\n" not in self.buf:
            chunk = os.read(self.r, 1 << 16)
            if not chunk:
                return None
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line

    def send(self, kind, obj):
        data = kind + json.dumps(obj).encode() + b"\n"
        while data:
            data = data[os.write(self.w, data):]


def _private_pipe():
    """The process's stdin/stdout as a :class:`Pipe`; fd 0 and 1 then point at /dev/null."""
    r, w, null = os.dup(0), os.dup(1), os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    return Pipe(r, w)


def _is_dunder(name):
    return name.startswith("__") and name.endswith("__")


# --------------------------------------------------------------------------------------------
# The program's process
# --------------------------------------------------------------------------------------------
def serve_program(source, test_timeout):
    pipe = _private_pipe()
    objs = []
    std = set(getattr(sys, "stdlib_module_names", ())) | {"builtins"}

    def handle(v):
        objs.append(v)
        return {"h": len(objs) - 1}

    def alarm(*_):
        raise TimeoutError("test_timeout")

    signal.signal(signal.SIGALRM, alarm)
    ns = {"__name__": "__solution__", "__builtins__": builtins}
    status = "ok"
    try:
        exec(compile(source, "<program>", "exec"), ns)
    except SystemExit as e:
        status = "ok" if e.code in (None, 0) else "exited with status %r" % (e.code,)
    except BaseException as e:
        status = "raised " + type(e).__name__

    def describe(name, v):
        mod = getattr(v, "__module__", None) if not isinstance(v, type(sys)) else None
        if isinstance(v, type(sys)) and v.__name__ == name and name in std:
            return {"m": name}  # ``import math``: the tests' process imports its own
        if isinstance(v, type) and issubclass(v, BaseException) and mod not in std:
            return {"x": next(c.__name__ for c in v.__mro__ if getattr(builtins, c.__name__, None) is c)}
        if isinstance(mod, str) and mod.split(".")[0] in std and isinstance(v, type) and issubclass(v, BaseException):
            try:
                obj = __import__(mod, fromlist=["_"])
                for part in v.__qualname__.split("."):
                    obj = getattr(obj, part)
                if obj is v:
                    return {"g": [mod, v.__qualname__]}
            except Exception:
                pass
        try:
            return {"v": encode(v, _refuse_other, n=[10_000])}
        except Exception:
            return handle(v)

    names = {}
    for name, v in list(ns.items()):
        if isinstance(name, str) and not _is_dunder(name):
            try:
                names[name] = describe(name, v)
            except BaseException:
                pass
    pipe.send(b"", {"program": status, "names": names})
    resolve = lambda i: objs[i]  # noqa: E731
    while True:
        line = pipe.readline()
        if line is None:
            os._exit(0)
        try:
            signal.setitimer(signal.ITIMER_REAL, test_timeout)
            try:
                answer = _answer(json.loads(line), objs, resolve, handle, ns)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except BaseException as e:
            answer = {"r": _raised(e, ns)}
        try:
            pipe.send(b"", answer)
        except BaseException as e:
            pipe.send(b"", {"r": ["Exception", "unencodable answer: %s" % type(e).__name__, None]})


def _refuse_other(v):
    raise TypeError("not plain data")


_PLAIN = {}


def _class_for(ns, name):
    """The program's class of that name if it defines one, else a plain class of that name made here."""
    c = ns.get(name)
    if isinstance(c, type) and c.__module__ == "__solution__":
        return c
    if name not in _PLAIN:
        _PLAIN[name] = type(name, (), {"__module__": "__solution__"})
    return _PLAIN[name]


def _set_state(obj, state):
    try:
        object.__getattribute__(obj, "__dict__").update(state)
    except AttributeError:  # a class of the program's with __slots__
        for k, v in state.items():
            object.__setattr__(obj, k, v)


def _answer(req, objs, resolve, handle, ns):
    op, target = req["o"], objs[req["h"]]
    # The test's objects in the arguments (a graph), rebuilt as the program's class of the same name
    # (``__init__`` not run); the same graph, after the call, goes back with the answer.
    n = [MAX_ELEMENTS]
    nodes, states = decode_graph(req.get("g", []), lambda i, name: object.__new__(_class_for(ns, name)), resolve, n)
    for obj, state in zip(nodes, states):
        _set_state(obj, state)
    args = [decode(a, resolve, 0, n, nodes) for a in req.get("a", [])]
    kwargs = {str(k): decode(v, resolve, 0, n, nodes) for k, v in req.get("k", {}).items()}
    name = str(req.get("n", ""))
    if _is_dunder(name):
        raise AttributeError(name)
    # An instance of the classes the test's objects came as, or of the program's class named like a class
    # the test file defines, goes back as data (a node); any other object of the program as a handle.
    as_data = {type(o).__name__ for o in nodes} | {str(c) for c in req.get("cls", [])}
    g = Graph(lambda v: type(v).__name__ in as_data and type(v) is _class_for(ns, type(v).__name__), handle, nodes)

    def answer(**a):
        if g.objs:
            a["g"] = g.table()
        return a

    enc = g.encode
    if op == "call":
        out = target(*args, **kwargs)
        post = [enc(a) if _mutable(a) else None for a in args]
        postk = {k: enc(v) for k, v in kwargs.items() if _mutable(v)}
        same = next((i for i, a in enumerate(args) if a is out and _mutable(a)), None)
        ans = {"p": post, "pk": postk}
        ans.update({"same": same} if same is not None else {"v": enc(out)})
        return answer(**ans)
    if op == "get":
        return answer(v=enc(getattr(target, name)))
    if op == "set":
        setattr(target, name, args[0])
        return {"v": None}
    simple = {"len": len, "bool": bool, "str": str, "iter": iter, "next": next}
    if op in simple:
        return answer(v=enc(simple[op](target)))
    if op == "getitem":
        return answer(v=enc(target[args[0]]))
    if op == "setitem":
        target[args[0]] = args[1]
        return {"v": None}
    if op == "isinstance":
        return {"v": isinstance(args[0], target)}
    raise ValueError("unknown request")


def _raised(e, ns):
    """An exception as ``[builtin base, message, the program's name for its class or None]``."""
    cls = type(e)
    own = next((k for k, v in ns.items() if v is cls and not _is_dunder(k)), None) if cls.__module__ != "builtins" else None
    base = next(c.__name__ for c in cls.__mro__ if getattr(builtins, c.__name__, None) is c)
    try:
        msg = str(e)[:500]
    except BaseException:
        msg = ""
    return [base, msg, own]


# --------------------------------------------------------------------------------------------
# The reference process
# --------------------------------------------------------------------------------------------
class Remote:
    """A program's object, seen from the tests: what may go to the program goes, the rest is refused."""

    __slots__ = ("_grpo_h",)

    def __init__(self, h):
        object.__setattr__(self, "_grpo_h", h)

    def __call__(self, *args, **kwargs):
        return _T.request("call", self, args, kwargs)

    def __getattr__(self, name):
        if _is_dunder(name):
            raise AttributeError(name)
        return _T.request("get", self, name=name)

    def __setattr__(self, name, value):
        if _is_dunder(name):
            raise AttributeError(name)
        _T.request("set", self, (value,), name=name)

    def __len__(self):
        return _T.request("len", self)

    def __bool__(self):
        return _T.request("bool", self)

    def __str__(self):
        return _T.request("str", self)

    def __iter__(self):
        return _T.request("iter", self)

    def __next__(self):
        return _T.request("next", self)

    def __getitem__(self, key):
        return _T.request("getitem", self, (key,))

    def __setitem__(self, key, value):
        _T.request("setitem", self, (key, value))

    def __instancecheck__(self, obj):
        return _T.request("isinstance", self, (obj,))

    def __repr__(self):
        return "<program object>"

    def _refuse(self, *_):
        _T.spoil("fail", "compared, hashed or searched a program object (a value that is not plain data): "
                         "never sent to the program, so the test fails")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __hash__ = __contains__ = _refuse


def _plain_class(c):
    """A class of the test file whose instances cross as data: its state is its ``__dict__`` (no slots, no
    base but ``object`` and the file's own plain classes, no custom pickling)."""
    return (c.__module__ == "__main__" and type(c) is type and globals().get(c.__name__) is not c  # not the harness's
            and c.__reduce_ex__ is object.__reduce_ex__
            and c.__reduce__ is object.__reduce__
            and getattr(c, "__getstate__", None) is getattr(object, "__getstate__", None)
            and all(b is object or (b.__module__ == "__main__" and "__slots__" not in b.__dict__) for b in c.__mro__))


class _TestRun:
    """The state of one test file's run in the reference child."""

    def __init__(self, pipe):
        self.pipe, self.spoiled, self.in_call, self.late, self.gone = pipe, None, False, False, None
        self.exc_classes, self.ns, self.program_names = {}, {}, set()

    def spoil(self, kind, why):
        self.spoiled = self.spoiled or (kind, why)
        raise Refused(why)

    def _send_arg(self, v):
        if isinstance(v, Remote):
            return {"h": v._grpo_h}
        self.spoil("unsupported", "the test passes a %s to the program: only plain data, instances of the test's "
                                  "own plain classes (attributes in their __dict__) and the program's own objects "
                                  "can be sent" % type(v).__name__)

    def test_classes(self):
        """The plain classes the test file defines at its top level, by name."""
        return {k: c for k, c in list(self.ns.items()) if isinstance(c, type) and c.__name__ == k and _plain_class(c)}

    def request(self, op, target, args=(), kwargs=None, name=None):
        if self.gone:
            self.spoil("fail", self.gone)
        g = Graph(lambda v: _plain_class(type(v)), self._send_arg)  # the arguments' own objects, and only those
        req = {"o": op, "h": target._grpo_h}
        if args:
            req["a"] = [g.encode(a) for a in args]
        if kwargs:
            req["k"] = {k: g.encode(v) for k, v in kwargs.items()}
        if g.objs:
            req["g"] = g.table()
        classes = self.test_classes()
        both = sorted(k for k in classes if k in self.program_names)
        if both:  # the program's instances of these classes come back as data (the program knows its class names)
            req["cls"] = both
        if name is not None:
            req["n"] = name
        line = self.exchange(req)
        if line[:1] != b"R":
            self.gone = "the program " + line[1:].decode(errors="replace")[:200]
            self.spoil("fail", self.gone)
        ans = json.loads(line[1:])
        resolve, sent, n = Remote, g.objs, [MAX_ELEMENTS]
        classes.update({type(o).__name__: type(o) for o in sent})

        def make(i, cls):  # a sent object is itself (updated in place below); a new one is of the test's class
            return sent[i] if i < len(sent) else object.__new__(classes[cls] if cls in classes else _bad())

        nodes, states = decode_graph(ans.get("g", []), make, resolve, n)
        for i, (obj, state) in enumerate(zip(nodes, states)):
            d = vars(obj)
            if i < len(sent):
                old = dict(d)
                d.clear()
                d.update({k: _merge(old[k], v) if k in old else v for k, v in state.items()})
            else:
                d.update(state)
        for dst, post in [*zip(args, ans.get("p", [])), *[(kwargs[k], v) for k, v in ans.get("pk", {}).items()
                                                          if k in (kwargs or {})]]:
            if post is not None:
                copy_into(dst, decode(post, resolve, 0, n, nodes))
        if "r" in ans:
            base, msg, own = ans["r"]
            cls = self.exc_classes.get(own) or getattr(builtins, str(base), None)
            if not (isinstance(cls, type) and issubclass(cls, Exception)) or cls in (StopAsyncIteration,):
                cls = StopIteration if base == "StopIteration" else None
            if cls is None:
                self.spoil("fail", "the program raised %s" % base)
            raise cls(msg)
        same = ans.get("same")
        if same is not None:
            if type(same) is not int or not 0 <= same < len(args) or not _mutable(args[same]):
                raise ValueError("malformed answer")
            return args[same]
        return decode(ans["v"], resolve, 0, n, nodes)

    def exchange(self, req):
        self.in_call = True
        try:
            self.pipe.send(b"C", req)
            line = self.pipe.readline()
        finally:
            self.in_call = False
        if line is None:
            os._exit(3)
        if self.late:
            self.late = False
            raise _UnitTimeout()
        return line


_T: _TestRun = None  # type: ignore[assignment]


class _UnitTimeout(BaseException):
    pass


def _contains_test(node, testfuncs):
    import ast

    return any(isinstance(n, ast.Assert) or (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                                             and n.func.id in testfuncs) for n in ast.walk(node))


def run_test_file(pipe, source, test_timeout):
    """Run one test file (in the reference child); ``U`` lines say each test's result."""
    global _T
    _T = t = _TestRun(pipe)
    import ast
    import unittest

    unittest.main = lambda *a, **k: None  # the TestCases run below, one test each

    def on_timer(*_):
        if t.in_call:
            t.late = True
        else:
            raise _UnitTimeout()

    signal.signal(signal.SIGPROF, on_timer)
    manifest = json.loads(t.exchange({"o": "hello", "h": -1})[1:])
    t.ns = ns = {"__name__": "__main__", "__builtins__": builtins}
    t.program_names = set(manifest.get("names", {}))
    dead = None if manifest.get("program") == "ok" else "the program " + str(manifest.get("program"))[:100]
    std = set(getattr(sys, "stdlib_module_names", ())) - {"antigravity", "this", "idlelib", "turtledemo"}
    for name, d in manifest.get("names", {}).items():
        if not isinstance(name, str) or not name.isidentifier() or _is_dunder(name) or not isinstance(d, dict):
            continue
        if hasattr(builtins, name):  # the tests' builtins stay Python's: a program's ``sorted = ...`` is not theirs
            continue
        try:
            # A standard module under its own name (``import math``; ``import os.path`` binds ``os``), a standard
            # exception class: the tests' process gets the real one. Any other object of the program (its
            # functions, ``import pickle as json``, ``f = eval``) is a stub: the program's code never runs here.
            if "m" in d and d["m"] == name and name in std:
                ns[name] = __import__(name)
            elif "g" in d and str(d["g"][0]).split(".")[0] in std:
                obj = __import__(d["g"][0], fromlist=["_"])
                for part in str(d["g"][1]).split("."):
                    obj = getattr(obj, part) if not _is_dunder(part) else _bad()
                if not (isinstance(obj, type) and issubclass(obj, BaseException)):
                    _bad()
                ns[name] = obj
            elif "x" in d:
                base = getattr(builtins, str(d["x"]), Exception)
                ns[name] = t.exc_classes[name] = type(name, (base if isinstance(base, type) and
                                                             issubclass(base, Exception) else Exception,), {})
            elif "v" in d:
                ns[name] = decode(d["v"], Remote)
            elif "h" in d and type(d["h"]) is int:
                ns[name] = Remote(d["h"])
        except Exception:
            pass
    sys.modules["solution"] = type(sys)("solution")  # `from solution import f` (pytest-style files)
    sys.modules["solution"].__dict__.update({k: v for k, v in ns.items() if not _is_dunder(k)})
    tree = ast.parse(source)
    lines = source.splitlines()
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    testfuncs = set()
    while True:
        more = {k for k, n in defs.items() if k not in testfuncs and _contains_test(n, testfuncs)}
        if not more:
            break
        testfuncs |= more
    called = {n.func.id for s in tree.body if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(s) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}

    def one(label, fn, is_test):
        t.spoiled, t.late = None, False
        err = None
        signal.setitimer(signal.ITIMER_PROF, test_timeout)
        try:
            fn()
        except SystemExit as e:
            err = None if e.code in (None, 0) else "exited with status %r" % (e.code,)
        except _UnitTimeout:
            err = "the test ran past test_timeout=%gs" % test_timeout
        except BaseException as e:
            err = "%s: %s" % (type(e).__name__, str(e)[:150]) if not isinstance(e, Refused) else str(e)
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
        kind, why = t.spoiled or (("fail", dead) if dead and (is_test or err) else ("fail", err) if err else
                                  ("pass", ""))
        if is_test or kind != "pass":
            pipe.send(b"U", [kind, label[:100], why if is_test else "setup statement: " + str(why)])

    for stmt in tree.body:
        label = (lines[stmt.lineno - 1] if stmt.lineno <= len(lines) else "").strip()
        code = compile(ast.Module([stmt], []), "<tests>", "exec")
        is_test = not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
            _contains_test(stmt, testfuncs)
        one(label, lambda: exec(code, ns), is_test)
    for name, fn in list(ns.items()):  # pytest-style functions nobody called
        if name.startswith("test") and name in defs and name not in called and callable(fn):
            one(name, fn, True)
    for cls in [v for v in list(ns.values()) if isinstance(v, type) and issubclass(v, unittest.TestCase)
                and v.__module__ == "__main__"]:
        for case in unittest.defaultTestLoader.loadTestsFromTestCase(cls):
            def run(case=case):
                res = unittest.TestResult()
                case.run(res)
                bad = res.errors + res.failures + res.unexpectedSuccesses
                if bad:
                    raise AssertionError(str(bad[0][1] if isinstance(bad[0], tuple) else bad[0])
                                         .strip().splitlines()[-1][:150])
            one(case.id().replace("__main__.", ""), run, True)
    pipe.send(b"E", 0)


def serve_tests():
    """The reference server: one forked child per test file (``N`` + JSON ``[source, test_timeout]``)."""
    pipe = Pipe(0, 1)
    null = os.open(os.devnull, os.O_RDWR)
    os.write(1, b"READY\n")
    # What test files import, imported once here: each forked child has them (a test file's cost stays its own).
    import ast  # noqa: F401
    import decimal  # noqa: F401
    import fractions  # noqa: F401
    import math  # noqa: F401
    import re  # noqa: F401
    import unittest  # noqa: F401

    while True:
        line = pipe.readline()
        if line is None:
            os._exit(0)
        source, test_timeout = json.loads(line[1:])
        pid = os.fork()
        if pid == 0:
            try:
                os.dup2(null, 2)
                mine = Pipe(os.dup(0), os.dup(1))
                os.dup2(null, 0)
                os.dup2(null, 1)
                run_test_file(mine, source, test_timeout)
                os._exit(0)
            except BaseException:
                os._exit(4)
        _, status = os.waitpid(pid, 0)
        if status:
            pipe.send(b"\nE", {"crashed": os.waitstatus_to_exitcode(status)})

"""Issue #37: LeetCode-style tests whose arguments are instances of classes the test file defines
(``ListNode``, ``TreeNode``, ``Node`` with neighbours).

Such an argument crosses as an object graph (nodes and references, never nesting: long lists, shared
nodes and cycles), is rebuilt in the program's process as the program's class of that name (else a
plain class of that name), and is copied back in place into the test's objects after the call; the
program's instances of a class the test file defines come back as data, rebuilt as the test's class.
Only the call's arguments cross: an expected tree built next to the argument never does."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest

from grpo_variants.rewards import harness, make_code_reward

from _process_finder import SEARCH


def _d(s: str) -> str:
    return textwrap.dedent(s).lstrip("\n")


HELPERS = _d(
    """
    class ListNode:
        def __init__(self, val=0, next=None):
            self.val = val
            self.next = next

    class TreeNode:
        def __init__(self, val=0, left=None, right=None):
            self.val = val
            self.left = left
            self.right = right

        def __eq__(self, other):
            return (isinstance(other, TreeNode) and self.val == other.val and self.left == other.left
                    and self.right == other.right)

    def build_list(xs):
        head = None
        for x in reversed(xs):
            head = ListNode(x, head)
        return head

    def to_list(h):
        out = []
        while h is not None:
            out.append(h.val)
            h = h.next
        return out

    def build_tree(xs, i=0):
        if i >= len(xs) or xs[i] is None:
            return None
        return TreeNode(xs[i], build_tree(xs, 2 * i + 1), build_tree(xs, 2 * i + 2))
    """
)

# (tests, a correct program, a wrong program). The programs define their own ListNode/TreeNode (as LeetCode
# solutions do) except where said: the arguments are then rebuilt as a plain class of that name.
CASES = {
    "reverse a list (the returned head is the test's own last node)": (
        _d("""
            h = build_list([1, 2, 3, 4, 5])
            last = h.next.next.next.next
            r = Solution().reverseList(h)
            assert r is last and to_list(r) == [5, 4, 3, 2, 1] and to_list(h) == [1]
            long = build_list(list(range(10000)))
            assert to_list(Solution().reverseList(long)) == list(range(9999, -1, -1))
            """),
        _d("""
            class ListNode:
                def __init__(self, val=0, next=None):
                    self.val, self.next = val, next
            class Solution:
                def reverseList(self, head):
                    prev = None
                    while head:
                        head.next, prev, head = prev, head, head.next
                    return prev
            """),
        _d("""
            class Solution:
                def reverseList(self, head):
                    return head
            """),
    ),
    "reorder a list in place (no class in the program)": (
        _d("""
            h = build_list([1, 2, 3, 4, 5])
            assert reorderList(h) is None
            assert to_list(h) == [1, 5, 2, 4, 3]
            """),
        _d("""
            def reorderList(head):
                nodes = []
                while head:
                    nodes.append(head)
                    head = head.next
                order = []
                i, j = 0, len(nodes) - 1
                while i <= j:
                    order.append(nodes[i])
                    if i != j:
                        order.append(nodes[j])
                    i, j = i + 1, j - 1
                for a, b in zip(order, order[1:]):
                    a.next = b
                order[-1].next = None
            """),
        "def reorderList(head):\n    pass\n",
    ),
    "a cycle and a shared tail": (
        _d("""
            c = build_list([1, 2, 3, 4])
            c.next.next.next.next = c.next
            assert hasCycle(c) is True
            assert hasCycle(build_list([1, 2])) is False
            tail = build_list([8, 9])
            a, b = ListNode(1, tail), ListNode(2, ListNode(3, tail))
            assert getIntersectionNode(a, b) is tail
            """),
        _d("""
            def hasCycle(head):
                slow = fast = head
                while fast and fast.next:
                    slow, fast = slow.next, fast.next.next
                    if slow is fast:
                        return True
                return False
            def getIntersectionNode(a, b):
                seen = set()
                while a:
                    seen.add(id(a))
                    a = a.next
                while b and id(b) not in seen:
                    b = b.next
                return b
            """),
        _d("""
            def hasCycle(head):
                return False
            def getIntersectionNode(a, b):
                return b
            """),
    ),
    "invert, flatten in place, build a tree from a list (returned as the test's TreeNode)": (
        _d("""
            assert invertTree(build_tree([4, 2, 7, 1, 3, 6, 9])) == build_tree([4, 7, 2, 9, 6, 3, 1])
            root = build_tree([1, 2, 5, 3, 4, None, 6])
            flatten(root)
            vals, n = [], root
            while n:
                assert n.left is None
                vals.append(n.val)
                n = n.right
            assert vals == [1, 2, 3, 4, 5, 6]
            t = sortedArrayToBST([1, 2, 3])
            assert isinstance(t, TreeNode) and t == build_tree([2, 1, 3])
            """),
        _d("""
            class TreeNode:
                def __init__(self, val=0, left=None, right=None):
                    self.val, self.left, self.right = val, left, right
            def invertTree(root):
                if root:
                    root.left, root.right = invertTree(root.right), invertTree(root.left)
                return root
            def flatten(root):
                order = []
                def walk(n):
                    if n:
                        order.append(n)
                        walk(n.left)
                        walk(n.right)
                walk(root)
                for a, b in zip(order, order[1:] + [None]):
                    a.left, a.right = None, b
            def sortedArrayToBST(nums):
                if not nums:
                    return None
                m = len(nums) // 2
                return TreeNode(nums[m], sortedArrayToBST(nums[:m]), sortedArrayToBST(nums[m + 1:]))
            """),
        _d("""
            class TreeNode:
                def __init__(self, val=0, left=None, right=None):
                    self.val, self.left, self.right = val, left, right
            def invertTree(root):
                return root
            def flatten(root):
                pass
            def sortedArrayToBST(nums):
                return TreeNode(nums[0])
            """),
    ),
    "clone a graph of nodes with neighbours (shared nodes, cycles)": (
        _d("""
            class Node:
                def __init__(self, val=0, neighbors=None):
                    self.val = val
                    self.neighbors = neighbors if neighbors is not None else []

            def edges(node):
                seen, out, todo = {}, set(), [node]
                while todo:
                    n = todo.pop()
                    if id(n) in seen:
                        continue
                    seen[id(n)] = n
                    out |= {(n.val, m.val) for m in n.neighbors}
                    todo += n.neighbors
                return out, set(seen)

            ns = [Node(i) for i in range(1, 5)]
            for i, n in enumerate(ns):
                n.neighbors = [ns[(i + 1) % 4], ns[(i - 1) % 4]]
            c = cloneGraph(ns[0])
            got, ids = edges(c)
            want, orig = edges(ns[0])
            assert got == want and not ids & orig
            """),
        _d("""
            class Node:
                def __init__(self, val=0, neighbors=None):
                    self.val = val
                    self.neighbors = neighbors if neighbors is not None else []
            def cloneGraph(node):
                copies = {}
                def go(n):
                    if n not in copies:
                        copies[n] = Node(n.val)
                        copies[n].neighbors = [go(m) for m in n.neighbors]
                    return copies[n]
                return go(node)
            """),
        "def cloneGraph(node):\n    return node\n",
    ),
}


def _python_verdict(tmp_path, name: str, program: str, tests: str) -> float:
    """``python program.py && python solution_and_tests.py``: as LeetCode runs a solution, the program and the
    tests in one file, so the test's ``class TreeNode`` (defined after the program's) is the class the
    program's code builds, as the judge's rule for returned nodes has it."""
    d = tmp_path / name
    d.mkdir()
    (d / "program.py").write_text(program)
    (d / "both.py").write_text(program + "\n" + tests)
    ok = subprocess.run([sys.executable, "program.py"], cwd=d, capture_output=True, timeout=60).returncode == 0
    ok = ok and subprocess.run([sys.executable, "both.py"], cwd=d, capture_output=True, timeout=60).returncode == 0
    return 1.0 if ok else 0.0


def test_leetcode_style_objects_score_what_python_says(tmp_path):
    names = sorted(CASES)
    completions = [CASES[n][1] for n in names] + [CASES[n][2] for n in names]
    tests = [[HELPERS + CASES[n][0]] for n in names] * 2
    want = [_python_verdict(tmp_path, f"{i}", p, t[0]) for i, (p, t) in enumerate(zip(completions, tests))]
    assert want == [1.0] * len(names) + [0.0] * len(names)  # the cases mean what they say
    reward = make_code_reward("all")
    got = reward(prompts=["p"] * len(completions), completions=completions, tests=tests)
    assert got == want, [(n, r) for n, g, w, r in zip(names * 2, got, want, reward.last_reasons) if g != w]


# The finder of tests/_process_finder.py, on nodes: it searches its whole process (frames, modules, gc.get_objects()
# and their attributes, every descriptor) for the sum the expected node holds, and returns a node of what it finds.
FINDER = SEARCH + _d(
    r'''

    class ListNode:
        def __init__(self, val=0, next=None):
            self.val, self.next = val, next

    def sum_list(head):
        found = _search(head.val + head.next.val)  # names what to look for; the value returned is the one found
        return ListNode(-1 if found is None else found)
    '''
)
A, B, C = 1000003, 2000005, 3000008


def test_a_program_searching_its_process_finds_no_expected_node():
    styles = {
        "asserts": f"head = build_list([{A}, {B}])\nexpected = build_list([{C}])\n"
                   "assert to_list(sum_list(head)) == to_list(expected)\n",
        "a table of (argument, expected) pairs": f"cases = [(build_list([{A}, {B}]), build_list([{C}]))]\n"
                                                 "for arg, exp in cases:\n    assert sum_list(arg).val == exp.val\n",
        "the expected node linked from nowhere but a test's own object": (
            f"class Case:\n    pass\ncase = Case()\ncase.arg = build_list([{A}, {B}])\ncase.want = ListNode({C})\n"
            "assert sum_list(case.arg).val == case.want.val\n"),
        "unittest": ("import unittest\nclass T(unittest.TestCase):\n    def test_sum(self):\n"
                     f"        h, e = build_list([{A}, {B}]), build_tree([{C}])\n"
                     "        self.assertEqual(sum_list(h).val, e.val)\n"),
    }
    correct = "class ListNode:\n    def __init__(self, val=0, next=None):\n        self.val, self.next = val, next\n" \
              "def sum_list(head):\n    return ListNode(head.val + head.next.val)\n"
    planted = FINDER + f"_planted = ListNode({C})\n"  # sanity: the same search finds a node's value really there
    names = sorted(styles)
    in_argument = f"head = build_list([{A}, {B}, {C}])\nassert sum_list(head).val == {C}\n"  # sent: found
    completions = [FINDER] * len(names) + [correct] * len(names) + [planted, FINDER]
    tests = [[HELPERS + styles[n]] for n in names] * 2 + [[HELPERS + styles["asserts"]], [HELPERS + in_argument]]
    reward = make_code_reward("all")
    out = reward(prompts=["p"] * len(completions), completions=completions, tests=tests)
    n = len(names)
    assert out[:n] == [0.0] * n, {k: (s, r) for k, s, r in zip(names, out, reward.last_reasons) if s}
    assert out[n:] == [1.0] * (n + 2), reward.last_reasons[n:]


def test_what_is_refused_and_what_stays_a_handle():
    slots = "class P:\n    __slots__ = ('x',)\n    def __init__(self, x):\n        self.x = x\nassert f(P(1)) == 1\n"
    reduce = "class P:\n    def __reduce__(self):\n        return (P, ())\nassert f(P()) == 1\n"
    with_fn = "class P:\n    pass\np = P()\np.key = len\nassert f(p) == 1\n"
    fail = make_code_reward("all", on_unsupported="fail")
    program = "def f(p):\n    return 1\n"
    out = fail(prompts=["p"] * 3, completions=[program] * 3, tests=[[slots], [reduce], [with_fn]])
    assert out == [0.0] * 3 and fail.last_unsupported == 3
    assert all("instances of the test's own plain classes" in r[0] for r in fail.last_reasons), fail.last_reasons
    # A program's instance of a class the test file does not define stays a handle (never compared): here the
    # test compares it with its own object of another class, and fails; the handle's attributes still work.
    handle = "class Q:\n    pass\nassert wrap(1).v == 1\nassert wrap(1) != Q()\n"
    wrapper = "class Box:\n    def __init__(self, v):\n        self.v = v\ndef wrap(v):\n    return Box(v)\n"
    # When the test file defines a class of that name, the program's instance comes back as data, the test's class.
    data = "class Box:\n    pass\nb = wrap(1)\nassert type(b) is Box and vars(b) == {'v': 1}\n"
    frac = make_code_reward("fraction")
    assert frac(prompts=["p"] * 2, completions=[wrapper] * 2, tests=[[handle], [data]]) == [0.5, 1.0], \
        frac.last_reasons


def test_object_graphs_are_bounded_and_flat():
    class Node:  # not a test file's class here: is_node says which objects are nodes
        pass

    head = None
    for i in range(50_000):  # a long list: one node after another, no nesting, so no depth limit is hit
        n = Node()
        n.val, n.next = i, head
        head = n
    g = harness.Graph(lambda v: isinstance(v, Node), lambda v: 1 / 0)
    msg = json.dumps({"a": [g.encode(head)], "g": g.table()})
    t = time.process_time()
    nodes, states = harness.decode_graph(json.loads(msg)["g"], lambda i, name: Node(), None, [harness.MAX_ELEMENTS])
    assert time.process_time() - t < 5.0 and len(nodes) == 50_000 and states[0]["next"] is nodes[1]
    cyc = [["N", {"next": {"o": 1}}], ["N", {"next": {"o": 0}}]]
    nodes, states = harness.decode_graph(cyc, lambda i, name: Node(), None, [harness.MAX_ELEMENTS])
    assert states[0]["next"] is nodes[1] and states[1]["next"] is nodes[0]
    for bad in ([["N", {"x": {"o": 2}}]], [["N", []]], [["not a name", {}]], [["N"]], {"N": {}}):
        with pytest.raises(Exception):
            harness.decode_graph(bad, lambda i, name: Node(), None, [harness.MAX_ELEMENTS])
    with pytest.raises(ValueError):  # the element count bounds nodes and values together
        harness.decode_graph([["N", {}]] * (harness.MAX_ELEMENTS + 1), lambda i, name: Node(), None, [10 ** 9])
    with pytest.raises(ValueError):
        harness.decode_graph([["N", {"v": list(range(10))}]] * 30_000, lambda i, name: Node(), None,
                             [harness.MAX_ELEMENTS])

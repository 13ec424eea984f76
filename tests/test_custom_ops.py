"""Our torch custom ops keep to what every supported torch can call.

torch 2.11 drops trailing arguments equal to their defaults before it bumps
the versions of the arguments an op mutates, so a mutated argument with a
default (``counters: Tensor | None = None``) raised IndexError in every eager
call there, while torch 2.13 (this machine's) ran it. The rule that keeps
both: no mutated argument has a default."""

from __future__ import annotations

import torch

import bubblefree.cuda_backend.backend  # noqa: F401 - registers every op of ours


def defaulted_mutated(name: str) -> list[str]:
    """The arguments of op ``name`` (``ns::op``) that are written and have a default."""
    ns, op = name.split("::")
    schema = getattr(getattr(torch.ops, ns), op).default._schema
    return [a.name for a in schema.arguments
            if a.alias_info is not None and a.alias_info.is_write and a.has_default_value()]


def ours() -> list[str]:
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("bubblefree::"))


def test_every_op_is_registered_where_the_step_imports_it():
    assert {"bubblefree::rope_attend", "bubblefree::paged_decode",
            "bubblefree::skinny_linear"} <= set(ours())


def test_no_op_of_ours_gives_a_mutated_argument_a_default():
    assert {name: defaulted_mutated(name) for name in ours() if defaulted_mutated(name)} == {}


def test_the_rule_sees_the_form_that_broke():
    @torch.library.custom_op("bubblefree_test::defaulted", mutates_args=("out", "count"))
    def defaulted(x: torch.Tensor, out: torch.Tensor, flag: bool = False,
                  count: torch.Tensor | None = None) -> torch.Tensor:
        return x.clone()

    @torch.library.custom_op("bubblefree_test::plain", mutates_args=("out", "count"))
    def plain(x: torch.Tensor, out: torch.Tensor, flag: bool,
              count: torch.Tensor | None) -> torch.Tensor:
        return x.clone()

    assert defaulted_mutated("bubblefree_test::defaulted") == ["count"]
    assert defaulted_mutated("bubblefree_test::plain") == []
    x = torch.zeros(2)
    assert torch.equal(plain(x, torch.zeros(2), False, None), x)  # None where it is mutated

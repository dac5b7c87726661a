"""Tasks and models used for evidence: everything runs offline.

* ``toy``            the toy kit: a tiny Qwen2 policy, a character tokenizer, arithmetic tasks
* ``toy_reasoning``  the chain-of-thought task (every partial sum written out)
* ``word_problems``  arithmetic word problems for small real chat models
* ``models``         real pretrained models obtained through the package index (SmolLM2-135M)
"""

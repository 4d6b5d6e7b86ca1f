"""``mpx.quantize.reference``, the pure-torch quantizer: :mod:`mpx.quantize.codec.reference`.

The module lives in ``codec/`` (issue 57: one subpackage a role). This path
stays because users import it by it (the README's API table; ``from
mpx.quantize import reference``). ``sys.modules`` maps this name to that
module itself: ``mpx.quantize.reference`` *is* ``mpx.quantize.codec.reference``.
The names bound below only tell type checkers what the module holds.
"""

import sys

from mpx.quantize.codec import reference

__all__ = [
    "check_output",
    "decode_codes",
    "dequantize",
    "dequantize_add",
    "draw_seed",
    "hash_uniform",
    "pack_codes",
    "quantize",
    "unpack_codes",
]

check_output = reference.check_output
decode_codes = reference.decode_codes
dequantize = reference.dequantize
dequantize_add = reference.dequantize_add
draw_seed = reference.draw_seed
hash_uniform = reference.hash_uniform
pack_codes = reference.pack_codes
quantize = reference.quantize
unpack_codes = reference.unpack_codes

sys.modules[__name__] = reference

import inspect
from megatron_ext.patching import wrap_method, Guarded, BYPASS_ATTR

calls = []
def rec(wrapped, inst, args, kwargs):
    calls.append((args, kwargs))
    return wrapped(*args, **kwargs)

class A:
    on = True
    def po(self, a, b=2, /, c=3, *rest, d, e=5, **kw): return (a, b, c, rest, d, e, kw)
    def only_self(self): return "x"
    def po_self(self, /): return "y"
    def varonly(self, *args, **kwargs): return (args, kwargs)
    def kwo(self, *, k=[1]): return k

for name in ["po", "only_self", "po_self", "varonly", "kwo"]:
    orig = A.__dict__[name]
    setattr(A, name, wrap_method(orig, Guarded(rec, "on", True), "t"))
    print(name, inspect.signature(A.__dict__[name]), inspect.signature(A.__dict__[name], follow_wrapped=False))
a = A()
print(a.po(1, 9, 8, 7, 6, d=4, z=1)); print(calls[-1])
print(a.po(1, d=4)); print(calls[-1])
print(a.only_self(), a.po_self(), a.varonly(1, 2, x=3), calls[-1], a.kwo())
A.on = False
print(a.po(1, 9, 8, 7, 6, d=4, z=1), a.po(1, d=4))
# stacking same test
A.on = True
orig = A.__dict__["po"]
setattr(A, "po", wrap_method(orig, Guarded(rec, "on", True), "t2"))
calls.clear(); print(a.po(1, d=4)); print(len(calls), calls)
A.on = False; calls.clear(); print(a.po(1, d=4), calls)
# error cases
try:
    A.po(a, b=2, a=1, d=4)
except TypeError as e: print("TypeError", e)

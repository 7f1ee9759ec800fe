"""The pure core: statistics, power and design, the decision rule, the mechanical classifier, the
pass schedule and the one definition of a first divergence. No I/O, clock, environment or print;
results are frozen dataclasses. Everything above builds on these modules; they import nothing above.
"""

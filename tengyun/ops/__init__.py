"""Operations tooling: pure functions (doctor, plan, bench, ...); only probe.py touches hardware."""

source scripts/_device_env.sh
python3 -m pytest -q -p no:cacheprovider -rA tests/probe/test_hydrate.py 2>&1 | tee $OUT/hydrate-tests.txt | grep -E "PASSED|FAILED|ERROR|passed|failed" | tail -20
timeout 380 scripts/device-ttft --sizes 16,32,64 --hydrate-bench 8 --images-root /dev/shm/cs-img --root /tmp/cs > $OUT/log.txt 2>&1; echo "rc $?"; grep -v '^{"stage"' $OUT/log.txt | tail -30

"""A scheduler process for the SIGKILL tests: feeds a fake trainer until `total` groups are trained.

usage: python scheduler_child.py BOOTSTRAP RUN TOTAL BATCH [die-after-publish]
With `die-after-publish` it SIGKILLs itself right after publishing its second TrainStep, before committing.
"""

import os
import signal
import sys
import time

from forge_stream.scheduler.consumer import SchedulerSettings, WindowedConsumer, recover
from forge_stream.scheduler.window import WindowSpec


class SlowTrainer:
    def __init__(self, version: int):
        self.policy_version = version

    def train(self, batch):
        time.sleep(0.3)
        self.policy_version += 1
        return {"loss": float(len(batch.samples))}


def main() -> None:
    bootstrap, run, total, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    settings = SchedulerSettings(bootstrap=bootstrap, run=run, batch_size=batch, window=WindowSpec(count=6))
    recovered = recover(settings)
    consumer = WindowedConsumer(settings, recovered=recovered)
    if sys.argv[5:] == ["die-after-publish"]:
        commit = consumer.commit

        def commit_or_die():
            if consumer.step == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            commit()

        consumer.commit = commit_or_die
    trainer = SlowTrainer(0 if recovered.last_version is None else recovered.last_version + 1)
    while len(consumer.retired) < total:
        if not consumer.run(trainer, steps=1, wait_s=60):
            sys.exit(3)
    consumer.close()


if __name__ == "__main__":
    main()

"""The event contract: every kind of event a process of this project writes, declared once.

Each event is declared, with its fields and the line a person reads for it, in the module of its
writer: :mod:`~elastic.event_types.agent` (with the launcher's), :mod:`~elastic.event_types.worker`
and :mod:`~elastic.event_types.faults`; :mod:`~elastic.event_types.contract` says what a
declaration is. Writers pass the declared type to :meth:`elastic.events.EventLog.emit`, which
refuses a name declared nowhere; readers (the invariant checker, the recovery report, the verdict,
the benchmarks, the progress display) pick events with :meth:`EventType.of` and
:meth:`EventType.matches`, and the progress display prints :func:`describe`. The files keep their
format (one JSON object per line, its name under ``"event"``), so old run directories still read.
``tests/test_event_types.py`` holds every emitting call, and every line, to its declaration.
"""

from elastic.event_types.agent import *  # noqa: F403
from elastic.event_types.contract import *  # noqa: F403
from elastic.event_types.faults import *  # noqa: F403
from elastic.event_types.worker import *  # noqa: F403

"""`python -m shmcoll.doctor`: the public command; the doctor is shmcoll/tools/doctor.py."""

if __name__ == "__main__":
    import sys

    from shmcoll.tools import doctor

    sys.exit(doctor.main())

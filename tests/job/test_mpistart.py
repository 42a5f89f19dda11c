"""Starting MPI: when mpiddp leaves Open MPI's libfabric BTL out, and when it leaves the choice to the user."""

from pathlib import Path

from mpiddp.job.mpistart import btl_already_chosen, btl_chosen_in, parameter_files


def test_a_parameter_file_chooses_the_btls_only_with_a_btl_line():
    assert btl_chosen_in("btl = self,vader,tcp\n")
    assert btl_chosen_in("# site settings\n  btl=^openib  # quiet on Ethernet\n")
    assert not btl_chosen_in("# btl = self,tcp\nbtl_tcp_if_include = eth0\nmpi_leave_pinned = 1\n")
    assert not btl_chosen_in("")


def test_the_users_installations_and_distributions_files_are_all_looked_at(tmp_path):
    library_dir = tmp_path / "openmpi" / "lib"
    files = parameter_files({"HOME": "/home/ana", "OPAL_PREFIX": "/opt/ompi"}, library_dir)
    assert files[0] == Path("/home/ana/.openmpi/mca-params.conf")
    assert Path("/opt/ompi/etc/openmpi-mca-params.conf") in files
    assert tmp_path / "openmpi" / "etc" / "openmpi-mca-params.conf" in files  # a prefix install
    assert Path("/etc/openmpi/openmpi-mca-params.conf") in files  # Debian and Ubuntu
    # Open MPI reads exactly the files this parameter names, when it is set
    assert parameter_files({"OMPI_MCA_mca_base_param_files": "/a.conf:/b.conf"}, library_dir) == [Path("/a.conf"), Path("/b.conf")]


def test_a_choice_in_the_environment_or_any_file_is_left_alone(tmp_path):
    quiet, chooses = tmp_path / "quiet.conf", tmp_path / "chooses.conf"
    quiet.write_text("mpi_leave_pinned = 1\n")
    chooses.write_text("btl = self,tcp\n")
    absent = tmp_path / "absent.conf"
    assert not btl_already_chosen({}, [quiet, absent])
    assert btl_already_chosen({}, [absent, quiet, chooses])
    assert btl_already_chosen({"OMPI_MCA_btl": "self,sm,tcp"}, [])  # mpirun --mca btl ... arrives here too

"""The persistent folder and the cloud behind it, in the order a checkpoint meets them: where the
folder is and mounting Drive (`mount`), one writer per folder (`lease`), the background copy to the
folder (`mirror`), what DriveFS says about uploads (`drivefs`), following each upload until it is
in the cloud (`cloud`), what may be deleted (`retention`), and measuring a Drive (`drivecheck`)."""

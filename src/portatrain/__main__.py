from portatrain.cli import main

main()
